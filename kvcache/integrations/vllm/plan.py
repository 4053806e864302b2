"""Scheduler-side bookkeeping: which tokens to load before a forward, which to store after it.

Pure Python on plain values (token lists, block-id lists), with no vLLM import, so the rules
can be tested without an engine. ``connector.py`` feeds it from vLLM's scheduler objects and
ships the resulting ``StepPlan`` to the workers as the connector metadata (a plain dataclass:
vLLM pickles it to the worker process in its multiprocess mode).

Rules:

* **Load** only what the daemon holds beyond vLLM's own (block-aligned) prefix hit, and never
  the whole prompt: vLLM must compute at least the last prompt token to sample from it.
* **Store** whole chunks only (the daemon ignores a partial one), once each: a request's
  stored watermark advances when its computed tokens cross a chunk boundary, prompt or
  output alike; chunks it just loaded count as stored. A finished request stores what is
  left (the chunk its last step completed) one step later, from blocks vLLM keeps until then.
* **Allocation reports** name each block once per request, with the tokens it holds, so the
  daemon's L0 lifecycle metrics see vLLM's real blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.integrations.vllm.group_pages import PageOp
from kvcache.observability.event import BlockAllocationRecord

_U64 = (1 << 64) - 1


@dataclass(slots=True)
class RetrieveSpec:
    """Copy the cached prefix ``token_ids`` into ``block_ids``, leaving the first
    ``skip_tokens`` (vLLM's own hit) alone."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_tokens: int
    cache_salt: str = ""
    key_extra: str = ""
    is_async: bool = False
    """vLLM waits for it (``WAITING_FOR_REMOTE_KVS``) instead of computing on the blocks in the
    same step; the workers report it in ``get_finished`` whatever its outcome."""
    awaited: tuple[int, int, int] = (0, 0, 0)
    """(chunks, ms, tokens): the leading chunks a prefill instance is storing, how long the
    daemon may wait for them (``disagg``; ``KVCacheClient.retrieve_reply_async``), and the
    prompt tokens they hold (a tail chunk holds fewer than a chunk: the rest is padding)."""
    pages: list[PageOp] = field(default_factory=list)
    """A hybrid model's other groups, restored with it (``group_plan.py``): the load is
    whole only if every one of them is."""


@dataclass(slots=True)
class StoreSpec:
    """Store the full chunks of ``token_ids`` held in ``block_ids``; ``block_hashes`` are
    vLLM's own hashes of those blocks (64-bit ints, as in vLLM's KV events) or None."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    block_hashes: list[int] | None = None
    cache_salt: str = ""
    stored_before: int = 0
    """The request's stored watermark before this store (what to fall back to if it fails)."""
    key_extra: str = ""
    final: bool = False
    """The request has finished and vLLM holds its blocks until the workers report this store
    done (``get_finished``), whether it succeeded or not."""


@dataclass(slots=True)
class StepPlan:
    """What the workers do around one forward pass."""

    retrieves: list[RetrieveSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    step: int = 0
    """This plan's number (1, 2, ...), as the workers tag the load failures they report."""
    failures_seen: int = -1
    """The last step whose load failures vLLM had processed when this plan was built: blocks
    those loads left unfilled are recomputed from this plan on. Under async scheduling the
    plans of the steps in between were built before vLLM knew, and still compute on them."""
    preempted: list[str] = field(default_factory=list)
    """Requests vLLM preempted when it scheduled this step: it freed their blocks, so the
    workers let their stores in flight finish before this step writes into any block."""
    idle: bool = False
    """No request is scheduled: no forward runs, and vLLM steps again at once. The workers
    may block briefly on their loads in flight (``ConnectorWorker.take_finished_recving``)."""
    page_stores: list[PageOp] = field(default_factory=list)
    """A hybrid model's other groups: the pages this step computed (``group_plan.py``)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """vLLM admitted a request and gave it blocks (``Planner.on_alloc``)."""

    req_id: str
    prompt: Sequence[int]
    block_ids: Sequence[int]
    """The blocks a load fills (empty when nothing is loaded)."""
    local_hit: int
    """Tokens vLLM's own prefix cache holds (a load skips them)."""
    external: int
    """Tokens promised to a load beyond ``local_hit`` (0: none)."""
    cache_salt: str = ""
    key_extra: str = ""
    is_async: bool = False
    awaited_tokens: int = 0
    """A decode request's leading prompt tokens a prefill instance is storing (``disagg``)."""
    wait_ms: int = 0
    """How long the daemon may wait for them."""
    pages: Sequence[PageOp] = ()
    """A hybrid model's page loads that go with the load (``RetrieveSpec.pages``)."""


@dataclass(slots=True)
class _Request:
    cache_salt: str
    key_extra: str = ""
    stored_tokens: int = 0
    reported_blocks: int = 0


def block_hash_to_int(h: bytes | int) -> int:
    """vLLM's ``BlockHash`` bytes as the 64-bit int its KV events publish."""
    return h & _U64 if isinstance(h, int) else int.from_bytes(h, "big") & _U64


class Planner:
    """Per-request state between scheduler steps; one instance per vLLM scheduler."""

    def __init__(self, block_size: int, chunk_size: int) -> None:
        if chunk_size <= 0 or block_size <= 0 or chunk_size % block_size:
            raise ValueError(
                f"chunk size {chunk_size} must be a positive multiple of block size {block_size}"
            )
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._reqs: dict[str, _Request] = {}
        self._retrieves: list[RetrieveSpec] = []
        self._final_stores: list[StoreSpec] = []

    def external_tokens(self, num_prompt_tokens: int, local_hit: int, daemon_hit: int) -> int:
        """Tokens to load beyond ``local_hit``, as ``get_num_new_matched_tokens`` returns them."""
        usable = min(daemon_hit, num_prompt_tokens - 1)
        return max(0, usable - local_hit)

    def on_alloc(self, admission: Admission) -> None:
        """A request got its blocks; queue its load (if any) for the next step's plan."""
        a = admission
        state = self._reqs.get(a.req_id)
        if state is None or a.external:
            state = self._reqs[a.req_id] = _Request(a.cache_salt, a.key_extra)
        if a.external <= 0:
            return
        hit = a.local_hit + a.external
        # Whole chunks: the daemon copies chunk by chunk; the tail of the last one lands in
        # slots vLLM allocated for the tokens it will compute and then overwrites.
        end = -(-hit // self.chunk_size) * self.chunk_size
        end = min(end, len(a.prompt))
        nblocks = -(-end // self.block_size)
        tokens, blocks = list(a.prompt[:end]), list(a.block_ids[:nblocks])
        awaited = min(a.awaited_tokens, end)
        wait = (awaited // self.chunk_size, a.wait_ms, awaited)
        spec = RetrieveSpec(
            a.req_id, tokens, blocks, a.local_hit, a.cache_salt, a.key_extra, a.is_async, wait, list(a.pages)
        )
        self._retrieves.append(spec)
        state.stored_tokens = (end // self.chunk_size) * self.chunk_size

    def step(
        self,
        scheduled: Sequence[tuple[str, int, int, Sequence[int], Sequence[int], Sequence[bytes | int]]],
    ) -> tuple[StepPlan, list[BlockAllocationRecord]]:
        """Plan one step. ``scheduled`` rows: ``(req_id, computed_before, num_scheduled,
        all_token_ids, block_ids, block_hashes)``; returns the plan and the allocation records."""
        plan = StepPlan(retrieves=self._retrieves, stores=self._final_stores)
        self._retrieves, self._final_stores = [], []
        records: list[BlockAllocationRecord] = []
        bs, cs = self.block_size, self.chunk_size
        for req_id, before, num_scheduled, tokens, block_ids, hashes in scheduled:
            state = self._reqs.get(req_id)
            if state is None:
                continue
            computed = min(before + num_scheduled, len(tokens))
            if len(block_ids) > state.reported_blocks:
                first = state.reported_blocks
                new_tokens = list(tokens[first * bs : min(len(block_ids) * bs, computed)])
                records.append(BlockAllocationRecord(req_id, list(block_ids[first:]), new_tokens))
                state.reported_blocks = len(block_ids)
            target = (computed // cs) * cs
            if target > state.stored_tokens and target // bs <= len(block_ids):
                nblocks = target // bs
                ints = [block_hash_to_int(h) for h in hashes[:nblocks]]
                plan.stores.append(
                    StoreSpec(
                        req_id,
                        list(tokens[:target]),
                        list(block_ids[:nblocks]),
                        ints if len(ints) == nblocks else None,
                        state.cache_salt,
                        state.stored_tokens,
                        state.key_extra,
                    )
                )
                state.stored_tokens = target
        return plan, records

    def store_due(self, req_id: str, computed: int, num_tokens: int) -> bool:
        """Whether ``step`` would store a chunk of ``req_id`` once its computed tokens reach
        ``computed`` (of its ``num_tokens``): a whole chunk past its stored watermark. False
        for a request it does not know (``step`` skips those). The scheduler half asks this
        before it reads vLLM's block table for a request, so that the steps between chunk
        boundaries, most of a decode, read no table."""
        state = self._reqs.get(req_id)
        if state is None:
            return False
        return min(computed, num_tokens) // self.chunk_size * self.chunk_size > state.stored_tokens

    def not_stored(self, req_id: str, stored_upto: int) -> None:
        """The workers report that ``req_id``'s chunks are stored only up to ``stored_upto``
        tokens (a store skipped after a failed load, or failed): lower the watermark so a
        later step stores the rest, from the bytes vLLM recomputed."""
        state = self._reqs.get(req_id)
        if state is not None:
            state.stored_tokens = min(state.stored_tokens, stored_upto // self.chunk_size * self.chunk_size)

    def preempted(self, req_id: str) -> None:
        """vLLM freed the request's blocks; on resumption it gets new ones, all to be reported."""
        state = self._reqs.get(req_id)
        if state is not None:
            state.reported_blocks = 0

    def final_store(
        self,
        req_id: str,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        computed: int,
        hashes: Sequence[bytes | int],
    ) -> bool:
        """A request finished with ``computed`` tokens' KV written: queue, for the next step,
        the whole chunks it has not stored yet. Under async scheduling the token a step feeds
        is not in the request's token list when that step is planned, so the chunk its last
        step completed is known only now. True if a store was queued (vLLM must then keep the
        blocks until the workers report it done)."""
        state = self._reqs.get(req_id)
        if state is None:
            return False
        target = min(computed, len(tokens)) // self.chunk_size * self.chunk_size
        nblocks = target // self.block_size
        if target <= state.stored_tokens or nblocks > len(block_ids):
            return False
        ints = [block_hash_to_int(h) for h in hashes[:nblocks]]
        self._final_stores.append(
            StoreSpec(
                req_id,
                list(tokens[:target]),
                list(block_ids[:nblocks]),
                ints if len(ints) == nblocks else None,
                state.cache_salt,
                state.stored_tokens,
                state.key_extra,
                final=True,
            )
        )
        state.stored_tokens = target
        return True

    def release(self, req_id: str) -> None:
        """Queue, for the next step, a store of nothing marked final: the workers report the
        request sent once the stores they still have in flight for it are settled (vLLM
        holds its blocks until then)."""
        state = self._reqs.get(req_id)
        salt, extra = (state.cache_salt, state.key_extra) if state is not None else ("", "")
        self._final_stores.append(StoreSpec(req_id, [], [], None, salt, 0, extra, final=True))

    def queue_retrieve(self, spec: RetrieveSpec) -> None:
        """Queue a load built elsewhere (a decode request's tail chunk) for the next plan."""
        self._retrieves.append(spec)

    def queue_final_store(self, spec: StoreSpec) -> None:
        """Queue a final store built elsewhere (a prefill request's tail chunk) for the next plan."""
        self._final_stores.append(spec)

    def stored(self, req_id: str) -> int:
        """The request's stored watermark in tokens (chunks stored or being stored), 0 if unknown."""
        state = self._reqs.get(req_id)
        return state.stored_tokens if state is not None else 0

    def finish(self, req_id: str) -> bool:
        """Forget a finished request; True if it was known."""
        return self._reqs.pop(req_id, None) is not None

    def __len__(self) -> int:
        return len(self._reqs)


__all__ = ["Admission", "Planner", "RetrieveSpec", "StepPlan", "StoreSpec", "block_hash_to_int"]
