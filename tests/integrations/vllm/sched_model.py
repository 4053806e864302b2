"""The model-free model of the scheduler harness: an oracle and a fake forward (vLLM venv).

``FakeForward`` writes at each position a value that is a function of the whole prefix and of
the request's identity (LoRA, images, prompt embeddings), and before writing it checks every
position of the context it reads. A wrong context is recorded and taints what the step writes
and samples, the way a real model would turn a wrong KV into wrong KV and wrong tokens.
``Oracle`` computes the same values from the tokens alone, so every chunk the daemon holds can
be compared with it byte for byte. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
LAYERS, KV_HEADS, HEAD = 2, 4, 64  # 64 KiB pages: even a 26-block cache passes the 1 MiB shared-memory floor
WIDTH = 2 * HEAD  # the CPU layout keeps K and V side by side in each (block, head) tile
VOCAB = 1000
_MASK = (1 << 40) - 1
_MUL = torch.arange(1, 2 * KV_HEADS * WIDTH, 2, dtype=torch.int64)  # one odd factor per element


def _next(h: int, token: int) -> int:
    digest = hashlib.blake2b(h.to_bytes(8, "little") + token.to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & _MASK


def identity_seed(identity: str) -> int:
    return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "little") & _MASK


def values(hashes: torch.Tensor, layer: int) -> torch.Tensor:
    """KV of positions with prefix hashes ``hashes`` in ``layer``: [n, kv_heads, WIDTH] float32,
    exact (every value is an integer below 2**24)."""
    v = (hashes[:, None] * _MUL[None, :] + layer * 7919) % 1_000_003
    return v.to(torch.float32).reshape(-1, KV_HEADS, WIDTH)


def sample(h: int) -> int:
    """The token a request samples after a prefix hashing to ``h`` (never 0-2)."""
    return 3 + h % (VOCAB - 3)


class Oracle:
    """The model, computed from tokens alone: prefix hashes, KV values and greedy outputs."""

    @staticmethod
    def hashes(identity: str, tokens: Sequence[int]) -> list[int]:
        h, out = identity_seed(identity), []
        for t in tokens:
            h = _next(h, t)
            out.append(h)
        return out

    @classmethod
    def generate(cls, identity: str, prompt: Sequence[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        hs = cls.hashes(identity, tokens)
        out: list[int] = []
        while len(out) < max_tokens:
            out.append(sample(hs[-1]))
            tokens.append(out[-1])
            hs.append(_next(hs[-1], out[-1]))
        return out

    @classmethod
    def kv(cls, identity: str, tokens: Sequence[int], layer: int) -> torch.Tensor:
        return values(torch.tensor(cls.hashes(identity, tokens), dtype=torch.int64), layer)


@dataclass
class _WorkerReq:
    identity: str
    tokens: list[int]
    num_prompt: int
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


@dataclass
class WrongRead:
    """A step read a context that differs from the oracle's."""

    step: int
    req_id: str
    first_bad_position: int
    block_ids: list[int]


class FakeForward:
    """The worker process: block tables from the scheduler output, the forward, the sampler."""

    def __init__(self, kv: list[torch.Tensor]) -> None:
        self.kv = kv
        self.reqs: dict[str, _WorkerReq] = {}
        self.wrong_reads: list[WrongRead] = []
        self.identities: dict[str, str] = {}
        """Set by the engine when a request is added: what its KV depends on besides tokens."""

    def update(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            state = self.reqs.get(new.req_id)
            if state is None:
                prompt = list(new.prompt_token_ids or [])
                state = self.reqs[new.req_id] = _WorkerReq(self.identities[new.req_id], prompt, len(prompt))
            state.blocks = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.reqs[req_id]
            # As vLLM's runner: drop sampled tokens the scheduler discarded (a step whose
            # load failed is recomputed, its sample thrown away).
            keep = state.num_prompt + cached.num_output_tokens[i]
            del state.tokens[keep:]
            del state.hashes[keep:]
            state.values = [v[:keep] for v in state.values]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.blocks = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.blocks.extend(new_ids[0])

    def _computed_before(self, out: SchedulerOutput) -> dict[str, int]:
        before = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return before

    def _oracle(self, state: _WorkerReq, upto: int) -> list[torch.Tensor]:
        """The oracle's KV of the request's first ``upto`` positions, per layer (cached)."""
        h = state.hashes[-1] if state.hashes else identity_seed(state.identity)
        have = len(state.hashes)
        while len(state.hashes) < upto:
            h = _next(h, state.tokens[len(state.hashes)])
            state.hashes.append(h)
        if len(state.hashes) > have or not state.values:
            fresh = torch.tensor(state.hashes[have:], dtype=torch.int64)
            old = state.values or [torch.empty(0, KV_HEADS, WIDTH)] * LAYERS
            state.values = [torch.cat([old[i][:have], values(fresh, i)]) for i in range(LAYERS)]
        return [v[:upto] for v in state.values]

    def _slots(self, state: _WorkerReq, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        blocks = torch.tensor(state.blocks, dtype=torch.int64)[pos // BLOCK]
        return blocks, pos % BLOCK

    def _first_wrong(self, state: _WorkerReq, start: int, oracle: list[torch.Tensor]) -> int | None:
        """The first context position whose KV differs from the oracle's, if any."""
        blocks, offs = self._slots(state, 0, start)
        first = None
        for layer, cache in enumerate(self.kv):
            diff = (cache[blocks, :, offs, :] != oracle[layer][:start]).flatten(1).any(1).nonzero()
            if len(diff):
                first = min(int(diff[0]), first if first is not None else start)
        return first

    def forward(self, step: int, out: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled positions of every request; sample where a prompt is done.

        As in a real forward, every request's new KV is written before any request reads its
        context (requests may share blocks through vLLM's prefix cache and recompute them in
        the same step); a request that read a wrong context rewrites its KV tainted, which may
        in turn taint another one's context, until nothing changes."""
        before = self._computed_before(out)
        work = []
        for req_id, n in out.num_scheduled_tokens.items():
            state, start = self.reqs[req_id], before[req_id]
            work.append((req_id, state, start, start + n, self._oracle(state, start + n)))
        for _, state, start, end, oracle in work:
            blocks, offs = self._slots(state, start, end)
            for layer, cache in enumerate(self.kv):
                cache[blocks, :, offs, :] = oracle[layer][start:end]
        tainted: dict[str, int] = {}
        changed = True
        while changed:
            changed = False
            for req_id, state, start, end, oracle in work:
                if req_id in tainted or not start:
                    continue
                bad = self._first_wrong(state, start, oracle)
                if bad is None:
                    continue
                tainted[req_id], changed = bad, True
                blocks, offs = self._slots(state, start, end)
                for layer, cache in enumerate(self.kv):
                    cache[blocks, :, offs, :] = oracle[layer][start:end] + 0.5
        req_ids, sampled = [], []
        for req_id, state, _start, end, _ in work:
            if req_id in tainted:
                self.wrong_reads.append(WrongRead(step, req_id, tainted[req_id], list(state.blocks)))
            req_ids.append(req_id)
            if end >= len(state.tokens):  # the prompt (or the fed token) is done: sample
                token = sample(state.hashes[end - 1]) if req_id not in tainted else 0
                state.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
