"""A model-free vLLM engine for the scheduler-level harness (runs in the vLLM venv only).

vLLM's real ``Scheduler`` / ``AsyncScheduler`` with ``KVCacheConnector`` as its scheduler half,
and in the same process a WORKER ``KVCacheConnector`` on KV tensors allocated the way vLLM's
CPU runner allocates them (raw byte buffers inside the connector's ``get_mem_pool_context``,
viewed as the CPU attention layout ``[blocks, kv_heads, block_size, 2 * head_size]``). Each
step follows vLLM's model runner: bind the metadata, ``start_load_kv``, forward,
``wait_for_save``, then the connector's outputs (``get_finished``, load errors as
``invalid_block_ids``, worker metadata) go to ``update_from_output``.

No model: ``FakeForward`` writes at each position a value that is a function of the whole
prefix and of the request's identity (LoRA, images, prompt embeddings), and before writing it
checks every position of the context it reads. A wrong context is recorded and taints what
the step writes and samples, the way a real model would turn a wrong KV into wrong KV and
wrong tokens. ``Oracle`` computes the same values from the tokens alone, so every chunk the
daemon holds can be compared with it byte for byte.

Not collected by pytest (no ``test_`` prefix): vLLM is not installed in the project's venv.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvcache.integrations.vllm.connector import KVCacheConnector, KVCacheMetadata
from kvcache.integrations.vllm.stats import Payload, merge

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


def vllm_config(
    model_dir: str,
    extra: dict[str, Any],
    *,
    async_scheduling: bool = False,
    max_batched: int = 96,
    max_seqs: int = 16,
) -> VllmConfig:
    model = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=4096,
    )
    sched = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    transfer = KVTransferConfig(
        kv_connector="KVCacheConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvcache.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    # vLLM's CPU platform turns async scheduling off (its runner cannot overlap steps); a GPU
    # engine runs with it, and the scheduler half of the connector must be right under both.
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def write_model_config(path: str) -> None:
    """A config.json is all ``ModelConfig`` reads; no weights, no tokenizer."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        torch_dtype="float32",
    ).save_pretrained(path)


@dataclass
class StepLog:
    """What one step did, for the checks: load errors reported, requests and their blocks."""

    step: int
    invalid_block_ids: set[int]
    blocks: dict[str, list[int]]


class Engine:
    """One vLLM engine: scheduler (with the connector's scheduler half) and one worker rank."""

    def __init__(self, config: VllmConfig, num_blocks: int) -> None:
        init_none_hash(sha256)
        page = KV_HEADS * BLOCK * WIDTH * 4
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],  # the scheduler never reads them; the worker allocates below
            kv_cache_groups=[
                KVCacheGroupSpec(
                    names,
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32
                    ),
                )
            ],
        )
        config.cache_config.num_gpu_blocks = num_blocks
        self.config = config
        cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        connector = self.scheduler.get_kv_connector()
        assert isinstance(connector, KVCacheConnector)
        self.sched_connector = connector
        self.worker = KVCacheConnector(config, KVConnectorRole.WORKER, kv_config)
        # As vLLM's CPU runner: raw byte buffers (inside the connector's allocation hook),
        # viewed as the CPU attention layout.
        with self.worker.get_mem_pool_context() or contextlib.nullcontext():
            raw = [torch.zeros(page * num_blocks, dtype=torch.int8) for _ in names]
        self.kv = [r.view(torch.float32).view(num_blocks, KV_HEADS, BLOCK, WIDTH) for r in raw]
        self.worker.register_kv_caches(dict(zip(names, self.kv, strict=True)))
        self.forward = FakeForward(self.kv)
        self.requests: dict[str, Request] = {}
        self.identity: dict[str, str] = {}
        self.steps: list[StepLog] = []
        self.worker_stats: Payload = {}
        self.planned_loads: dict[str, int] = {}
        """Tokens the scheduler half planned to load, per request (whatever the daemon then had)."""
        self.between_schedule_and_load: Callable[[int, SchedulerOutput], None] | None = None
        """Hook: runs after ``schedule()`` and before the worker's load (evict, kill, ...)."""
        self.before_schedule: Callable[[int], None] | None = None
        """Hook: runs where vLLM's engine core takes new requests and aborts (under async
        scheduling, while the previous step is still in flight)."""
        self.aborted: set[str] = set()

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, *, identity: str = "", **kw: Any
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, 2)
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            **kw,
        )
        self.requests[req_id] = request
        self.identity[req_id] = identity
        self.forward.identities[req_id] = identity
        self.scheduler.add_request(request)
        return request

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The worker's ``execute_model`` with vLLM's connector order."""
        step = len(self.steps)
        if self.between_schedule_and_load is not None:
            self.between_schedule_and_load(step, out)
        self.forward.update(out)
        worker = self.worker
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVCacheMetadata)
        for load in meta.plan.loads:
            self.planned_loads[load.req_id] = (
                self.planned_loads.get(load.req_id, 0) + len(load.token_ids) - load.skip_tokens
            )
        worker.bind_connector_metadata(meta)
        # As vLLM's runner: synchronous loads feed this step's forward; asynchronous ones
        # start after it (their requests are not in it).
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
        result = (
            self.forward.forward(step, out)
            if out.total_num_scheduled_tokens
            else ModelRunnerOutput(req_ids=[], req_id_to_index={})
        )
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(out.finished_req_ids)
        conn = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        if conn.kv_connector_stats is not None:
            merge(self.worker_stats, conn.kv_connector_stats.data)
        result.kv_connector_output = conn
        blocks = {r: list(self.forward.reqs[r].blocks) for r in out.num_scheduled_tokens}
        self.steps.append(StepLog(step, set(conn.invalid_block_ids), blocks))
        return result

    def run(self, max_steps: int = 2000) -> None:
        """Step until every request finished; under async scheduling the next step is
        scheduled (and executed) before the previous one's output is processed, as in
        vLLM's batch queue."""
        pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        is_async = self.config.scheduler_config.async_scheduling
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and pending is None:
                return
            if self.before_schedule is not None:
                self.before_schedule(len(self.steps))
            out = self.scheduler.schedule()
            result = self._execute(out)
            if is_async:
                if pending is not None:
                    self.scheduler.update_from_output(*pending)
                pending = (out, result)
            else:
                self.scheduler.update_from_output(out, result)
            if is_async and not self.scheduler.has_requests():
                self.scheduler.update_from_output(*pending)  # type: ignore[misc]
                pending = None
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def abort(self, req_id: str) -> None:
        """As a client disconnect: vLLM finishes the request as aborted."""
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(req_id)

    @property
    def is_async(self) -> bool:
        return isinstance(self.scheduler, AsyncScheduler)

    def outputs(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    def tally(self) -> dict[str, float]:
        """Both halves' counters since start, as vLLM's metrics would sum them."""
        totals: dict[str, float] = {k: v for k, v in self.worker_stats.items() if not isinstance(v, list)}
        for k, v in self.sched_connector.tally.totals().items():
            totals[k] = totals.get(k, 0) + v
        return totals

    def check_wrong_reads(self) -> None:
        """A wrong context may only be read in a step whose load errors vLLM was told about
        (it discards that step's output for the request and recomputes), or under async
        scheduling in the step after, which was scheduled before vLLM heard of them."""
        by_step = {s.step: s for s in self.steps}
        for w in self.wrong_reads():
            bad_block = w.block_ids[w.first_bad_position // BLOCK]
            told = set(by_step[w.step].invalid_block_ids)
            if self.is_async and w.step > 0:
                told |= by_step[w.step - 1].invalid_block_ids
            assert bad_block in told, (
                f"step {w.step}: {w.req_id} read a wrong KV at position {w.first_bad_position} "
                f"(block {bad_block}) that no load error reported ({sorted(told)})"
            )

    def wrong_reads(self) -> list[WrongRead]:
        return self.forward.wrong_reads

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.sched_connector.shutdown()
