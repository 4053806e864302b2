"""The hybrid harness's model: a full-attention, a sliding-window and a Mamba group (vLLM venv).

``HybridForward`` writes each group's state where vLLM's block tables say: per-token KV for
the attention groups, and for the Mamba group the recurrent state after each block's last
position (and after the last position computed), in the block holding that position. Before
computing from a position it reads every group's context back: the whole full-attention
prefix, the sliding-window group's window, the Mamba state at the position before. A wrong
context is recorded (``WrongRead``) and taints what the step writes and samples, so a request
gets the oracle's next token (``Oracle.generate``) only if every group's state is right.
Separate from ``sched_hybrid.py`` (engine, scenarios, controls) because it is the one part
that knows what each group holds. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput

from tests.integrations.vllm.sched_model import BLOCK, HEAD, KV_HEADS, Oracle, values

WINDOW = 64  # the sliding-window group's window, in tokens (two blocks)
STATE = (4, 8)  # one Mamba layer's state per block: 32 float32 values
GROUPS = ("full", "swa", "mamba")
LAYER_OF = {"full": "model.layers.0.self_attn.attn", "swa": "model.layers.1.self_attn.attn",
            "mamba": "model.layers.2.mixer"}  # fmt: skip


def state_of(h: int) -> torch.Tensor:
    """The Mamba state after a prefix hashing to ``h`` (exact small integers as float32)."""
    return values(torch.tensor([h], dtype=torch.int64), 99).flatten()[: STATE[0] * STATE[1]].view(STATE)


def hybrid_kv_config(num_blocks: int) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    swa = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32, sliding_window=WINDOW
    )
    mamba = MambaSpec(
        block_size=BLOCK, shapes=(STATE,), dtypes=(torch.float32,), page_size_padded=full.page_size_bytes
    )
    specs = {"full": full, "swa": swa, "mamba": mamba}
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # the scheduler never reads them; the worker allocates below
        kv_cache_groups=[KVCacheGroupSpec([LAYER_OF[g]], specs[g]) for g in GROUPS],
    )


@dataclass
class _Req:
    identity: str
    tokens: list[int]
    num_prompt: int
    blocks: list[list[int]] = field(default_factory=lambda: [[], [], []])


@dataclass
class WrongRead:
    step: int
    req_id: str
    group: str
    position: int


class HybridForward:
    """The worker's model: writes and checks every group's state (module docstring)."""

    def __init__(self, full: torch.Tensor, swa: torch.Tensor, mamba: torch.Tensor) -> None:
        self.full, self.swa, self.mamba = full, swa, mamba
        self.reqs: dict[str, _Req] = {}
        self.identities: dict[str, str] = {}
        self.wrong_reads: list[WrongRead] = []

    def update(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            state = self.reqs.get(new.req_id)
            if state is None:
                prompt = list(new.prompt_token_ids or [])
                state = self.reqs[new.req_id] = _Req(self.identities[new.req_id], prompt, len(prompt))
            state.blocks = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.reqs[req_id]
            del state.tokens[state.num_prompt + cached.num_output_tokens[i] :]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.blocks = [list(ids) for ids in new_ids] if new_ids else [[], [], []]
            elif new_ids:
                for g, ids in enumerate(new_ids):
                    state.blocks[g].extend(ids)

    def _first_wrong(self, state: _Req, start: int, hashes: list[int]) -> tuple[str, int] | None:
        """The first group whose context for computing from ``start`` differs from the oracle."""
        if start == 0:
            return None
        full, swa, mamba = state.blocks
        want = values(torch.tensor(hashes[:start], dtype=torch.int64), 0)
        pos = torch.arange(start)
        have = self.full[torch.tensor(full)[pos // BLOCK], :, pos % BLOCK, :]
        bad = (have != want).flatten(1).any(1).nonzero()
        if len(bad):
            return "full", int(bad[0])
        lo = max(0, start - WINDOW + 1)
        pos = torch.arange(lo, start)
        ids = torch.tensor(swa)[pos // BLOCK]
        want = values(torch.tensor(hashes[lo:start], dtype=torch.int64), 1)
        bad = ((self.swa[ids, :, pos % BLOCK, :] != want).flatten(1).any(1) | (ids == 0)).nonzero()
        if len(bad):
            return "swa", lo + int(bad[0])
        block = mamba[(start - 1) // BLOCK]
        if block == 0 or not torch.equal(self.mamba[block], state_of(hashes[start - 1])):
            return "mamba", start - 1
        return None

    def forward(self, step: int, out: SchedulerOutput) -> ModelRunnerOutput:
        before = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            state, start = self.reqs[req_id], before[req_id]
            end = start + n
            hashes = Oracle.hashes(state.identity, state.tokens[:end])
            wrong = self._first_wrong(state, start, hashes)
            if wrong is not None:
                self.wrong_reads.append(WrongRead(step, req_id, *wrong))
            taint = 0.5 if wrong is not None else 0.0
            pos = torch.arange(start, end)
            fresh = torch.tensor(hashes[start:end], dtype=torch.int64)
            full, swa, mamba = (torch.tensor(ids, dtype=torch.int64) for ids in state.blocks)
            self.full[full[pos // BLOCK], :, pos % BLOCK, :] = values(fresh, 0) + taint
            self.swa[swa[pos // BLOCK], :, pos % BLOCK, :] = values(fresh, 1) + taint
            for p in range(start, end):  # the state after each block's last position, and the last
                if p == end - 1 or p % BLOCK == BLOCK - 1:
                    self.mamba[int(mamba[p // BLOCK])] = state_of(hashes[p]) + taint
            req_ids.append(req_id)
            if end >= len(state.tokens):
                token = Oracle.generate(state.identity, state.tokens[:end], 1)[0] if wrong is None else 0
                state.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )


__all__ = [
    "GROUPS",
    "LAYER_OF",
    "STATE",
    "WINDOW",
    "HybridForward",
    "WrongRead",
    "hybrid_kv_config",
    "state_of",
]
