"""The retrieve path: L2 -> L1 prefetch, and retrieve into engine blocks (lookups: ``lookup``).

Separate from the engine facade because these three share one rule, kept in one place: the
prefix is made of chunks in L1 and chunks present in L2 (tiers asked in order), in any
alternation (a prompt's tail may stay in L1 after its head left for L2), and the first missing
chunk, refused load or failed load ends it; a retrieve waits for the loads a lookup began,
never on its caller's thread: a prefix still loading is waited for on the engine's retrieve
waiter (see ``waiter``), woken by ``EngineParts.loads_settled`` as each load settles.

A retrieve's own loads take room within its tenant's share of L1 (``storage.shares``),
evicting that tenant's chunks nobody pins; where only the chunks it pins itself could give
room (a prompt longer than its share, or than L1), the load is refused at once and the prefix
it holds is returned (``retrieved_tokens`` short of the lookup's hit). Waiting could never
help: those pins go only when it ends. Taking the room from a tenant holding less would break
the shares' rule, and evicting its own head for its tail would shorten the prefix.

A chunk is read from L2 once however many requests need it at the same time: a load in
flight is an L1 entry in LOADING, and every later lookup or retrieve of that chunk joins it
(``L1Pool.resident``, ``acquire``) instead of reading it again. Each waiting retrieve is
copied as soon as its own chunks settled (``waiting.WaitingRetrieves``), whatever the others
wait for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvcache.deadline import Deadline
from kvcache.engine.instance import InstanceState
from kvcache.engine.parts import EngineParts
from kvcache.engine.records import CopyTally
from kvcache.engine.waiting import notify_settled
from kvcache.errors import DeadlineExceededError
from kvcache.futures import failed
from kvcache.ids import Ids
from kvcache.observability.event import EventType, MpRetrieveStart
from kvcache.records import ChunkKey, RetrieveResult
from kvcache.request import RetrieveRequest
from kvcache.storage.l1.pool import L1Entry
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.transfer.base import Direction, TransferResult

logger = logging.getLogger("kvcache.engine.engine")  # the engine's logger name, as before the split


def prefetch(
    parts: EngineParts,
    inst: InstanceState,
    keys: Sequence[ChunkKey],
    deadline: Deadline | None = None,
    room_by: Deadline | None = None,
    held: Sequence[L1Entry] = (),
) -> int:
    """Start loading the leading ``keys`` found in L2 into L1; returns how many started.

    Without ``deadline`` (a lookup) no queue is waited for: a full load queue ends the prefix
    early. A retrieve passes its deadline, so a chunk its lookup promised is not lost to a busy
    queue. L1 room held by operations in flight is waited for until ``room_by`` (a lookup's
    short bound), else ``deadline``: back-to-back lookups must not find every slot pinned by
    the previous ones' loads and answer a miss for chunks L2 holds. ``held``: the entries
    the caller pins (a retrieve's prefix): never waited for (``L1Pool.begin_load``).
    """
    if not keys or not parts.tiers:
        return 0
    source: list[AsyncL2 | None] = [None] * len(keys)
    for tier in parts.tiers:
        missing = [i for i, s in enumerate(source) if s is None]
        if not missing:
            break
        for i, present in zip(missing, tier.contains([keys[i] for i in missing]), strict=True):
            if present:
                source[i] = tier
    n = next((i for i, s in enumerate(source) if s is None), len(keys))
    room = room_by if room_by is not None else deadline
    room_s = 0.0 if room is None else room.left()
    entries = parts.pool.begin_load(inst.slot_shape, keys[:n], wait_s=room_s, tenant=inst.tenant, held=held)
    for i, entry in enumerate(entries):
        src = source[i]
        assert src is not None

        def done(ok: bool, entry: L1Entry = entry) -> None:
            parts.pool.finish([entry], ok)
            notify_settled(parts.loads_settled, (entry.key,), parts.waiting)  # its waiters look again

        wait_s = 0.0 if deadline is None else deadline.left()
        if not src.submit_load(entry.key, entry.tensor, done, wait_s):
            parts.pool.finish(entries[i:], False)
            notify_settled(parts.loads_settled, [e.key for e in entries[i:]], parts.waiting)
            return i
    return len(entries)


def retrieve_async(parts: EngineParts, inst: InstanceState, req: RetrieveRequest) -> Future[RetrieveResult]:
    """See ``CacheEngine.submit_retrieve``. Never raises: every error is set on the future.

    The caller's thread checks the request, pins the leading chunks resident in L1 and, when
    they are all READY and nothing more could come from L2, submits the copy; a prefix still
    loading (or needing a prefetch) is handed to the engine's retrieve waiter, whose pass
    waits for it (``_RetrieveOp.wait_pass``) and submits the copy. Its completion on the
    instance's completer thread releases the chunks, publishes the end event and resolves.
    """
    try:
        op = _RetrieveOp.begin(parts, inst, req)
    except Exception as err:  # a bad request: nothing was pinned or published
        return failed(err)
    future = op.future
    try:
        if op.ready_now():
            op.copy()
            return future
        if not op.needs_prefetch():
            with parts.loads_settled:  # its chunks are all loading: it waits from now on
                parts.waiting.add(op)
        parts.retrieve_waiter.add(inst.instance_id, op.wait_pass)
    except Exception as err:  # never leave the future unresolved, nor a chunk pinned
        if op.claim():
            op.fail(err)
            op.served.set()
    return future


@dataclass(eq=False)
class _RetrieveOp:
    """One retrieve past its checks (``MP_RETRIEVE_START`` published). ``pinned`` (the
    leading entries of ``keys``) passes from the caller's thread to the waiter's, and from
    there to the copy's completion, one thread at a time: whoever holds the op releases it."""

    parts: EngineParts
    inst: InstanceState
    sid: str
    num_tokens: int
    skip: int  # tokens left alone (whole blocks)
    local_skip: int  # blocks of the first chunk left alone
    keys: list[ChunkKey]  # from the first chunk with a block to copy
    ids: Ids  # the block ids of ``keys``
    req_deadline: Deadline | None  # the request's: no byte is written into its blocks after it
    deadline: Deadline  # the end of any wait for loads (``retrieve_wait_timeout_s``, ``req_deadline``)
    await_n: int = 0  # leading ``keys`` another engine is storing: waited for until ``deadline``
    await_upto: int = 0  # ... as a prefix of the request's tokens
    future: Future[RetrieveResult] = field(default_factory=Future)
    pinned: list[L1Entry] = field(default_factory=list)
    claimed: bool = False  # its wait is over: one thread cuts and copies it (``claim``)
    served: threading.Event = field(default_factory=threading.Event)  # ... and has done so
    settled_upto: int = 0  # leading ``pinned`` entries known settled (``waiting``)

    @classmethod
    def begin(cls, parts: EngineParts, inst: InstanceState, req: RetrieveRequest) -> _RetrieveOp:
        """Key the request (checked when it was built) and publish ``MP_RETRIEVE_START``."""
        ctx = inst.ctx
        num_tokens, skip_tokens = len(req.token_ids), req.skip_tokens
        bs, bpc, cs = ctx.block_size, ctx.blocks_per_chunk, ctx.chunk_size
        keys = inst.request_keys(req)
        if skip_tokens > len(keys) * cs:
            # The engine cannot already hold more of this request than the request has: a
            # larger skip is clamped, so the answer never claims tokens that do not exist.
            skip_tokens = len(keys) * cs
        if skip_tokens % bs:
            logger.info(
                "retrieve: skip_tokens=%d is not a multiple of block size %d; rounded down", skip_tokens, bs
            )
        skip_blocks = skip_tokens // bs
        ids = req.block_ids
        sid = parts.events.session(inst.instance_id, req.request_id)
        skip = skip_blocks * bs
        parts.events.publish(
            EventType.MP_RETRIEVE_START,
            sid,
            inst.meta(MpRetrieveStart, num_tokens=num_tokens, skip_tokens=skip),
        )
        first = skip_blocks // bpc  # the first chunk with a block to copy
        req_deadline = req.deadline
        wait_s = parts.config.retrieve_wait_timeout_s
        if req.await_chunks:  # a prefill/decode split: the caller's bound on the wait for a store
            wait_s = min(wait_s, req.await_s)
        deadline = Deadline.within(wait_s).earliest(req_deadline)
        local_skip = skip_blocks - first * bpc
        awaited = max(0, req.await_chunks - first), req.await_chunks * cs
        return cls(parts, inst, sid, num_tokens, skip, local_skip, keys[first:], ids[first * bpc :],
                   req_deadline, deadline, *awaited)  # fmt: skip

    # -- caller's thread ------------------------------------------------------------------
    def ready_now(self) -> bool:
        """Pin the leading resident chunks; True (``pinned`` cut to the READY ones) when the
        copy need not wait: nothing pinned is still loading, and L2 could add nothing."""
        self.pinned = self.parts.pool.acquire(self.keys)
        ready, loading = _leading_ready(self.pinned)
        if loading or len(self.pinned) < self.await_n:
            return False
        if ready == len(self.pinned) < len(self.keys) and self.parts.tiers:
            return False
        self._cut(ready)
        return True

    def needs_prefetch(self) -> bool:
        """True when chunks past ``pinned`` may still come from L2 (a pass must look)."""
        return len(self.pinned) < len(self.keys) and bool(self.parts.tiers)

    def claim(self) -> bool:
        """Take the op's end for this thread; False when another thread took it first."""
        with self.parts.loads_settled:
            if self.claimed:
                return False
            self.claimed = True
            self.parts.waiting.discard(self)
            return True

    # -- waiter's thread ------------------------------------------------------------------
    def wait_pass(self, stop: threading.Event) -> None:
        """Bring in what L2 holds of the rest of the prefix, then wait until its chunks
        settled, the deadline, or at once when ``stop`` is set (the engine or instance is
        closing); then copy what is READY. The first miss or failed load ends the prefix.

        While it waits, this pass serves every retrieve in ``EngineParts.waiting`` whose own
        chunks settled (or whose deadline passed), not only its own: a retrieve's copy starts
        when its chunks are in L1, never behind another retrieve's loads. An op that another
        pass served already ends here at once."""
        parts = self.parts
        try:
            with parts.loads_settled:
                claimed, waiting = self.claimed, self in parts.waiting
            if claimed:
                self.served.wait()
                return
            if not waiting:
                self._bring_in(stop)
                with parts.loads_settled:
                    parts.waiting.add(self)
            parts.waiting.serve(self, stop, parts.retrieve_waiter.hand_over)
        except Exception as err:  # never leave the future unresolved, nor a chunk pinned
            if self.claim():
                self.fail(err)
                self.served.set()

    def _bring_in(self, stop: threading.Event) -> None:
        """Pin the rest of the prefix: chunks already in L1 or loading (whoever began the
        load), and loads begun now for the chunks L2 holds, until a miss, or until L1 has no
        room for this tenant that any pin but this retrieve's own could free: it would wait
        for itself, so the prefix ends there at once (``L1Pool.begin_load``'s ``held``)."""
        parts, keys, entries = self.parts, self.keys, self.pinned
        while not stop.is_set() and len(entries) < len(keys):
            rest = keys[len(entries) :]
            more = parts.pool.acquire(rest)
            if not more:
                prefetch(parts, self.inst, rest, self.deadline, held=entries)
                more = parts.pool.acquire(rest)  # the loads just begun, or begun by another
                if not more:  # a miss, or they failed already
                    break
            entries += more

    def settled(self) -> bool:
        """(``loads_settled`` held) Whether every pinned chunk settled, or one failed (the
        prefix ends there), and the awaited chunks are all pinned (or its deadline passed):
        its copy need wait no longer. An awaited chunk is pinned once its store made it
        READY (a chunk being written is never pinned); every store's end wakes this check."""
        entries = self.pinned
        while True:
            while self.settled_upto < len(entries):
                entry = entries[self.settled_upto]
                if not entry.wait(0):
                    return not entry.ok
                self.settled_upto += 1
            if len(entries) >= self.await_n or self.deadline.passed():
                return True
            more = self.parts.pool.acquire(self.keys[len(entries) :])
            if not more:
                return False
            entries += more

    def waits_on(self) -> ChunkKey | None:
        """(``loads_settled`` held, after ``settled`` said False) The pinned chunk still
        loading, else the awaited chunk not yet stored: the one whose change may settle it."""
        entries = self.pinned
        if self.settled_upto < len(entries):
            return entries[self.settled_upto].key
        return self.keys[len(entries)] if len(entries) < len(self.keys) else None

    def polls(self) -> bool:
        """(``loads_settled`` held) Awaited chunks are missing and an L2 tier may bring them
        (another daemon sharing the L2 is storing them: nothing here is told when it lands)."""
        return bool(self.parts.tiers) and len(self.pinned) < self.await_n and not self.claimed

    def poll(self) -> None:
        """Begin loading the awaited chunks L2 holds now; ``settled`` pins them (they are in
        L1, LOADING) and their loads' ends wake the waiting set."""
        rest = self.keys[len(self.pinned) : self.await_n]
        if rest and not self.parts.pool.prefix(rest[:1]):
            prefetch(self.parts, self.inst, rest, self.deadline, room_by=Deadline.within(0.0))  # no room wait

    def finish_wait(self) -> None:
        """(Claimed) Copy the READY prefix of ``pinned``; the first unsettled or failed chunk
        ends it."""
        try:
            self._cut(next((i for i, e in enumerate(self.pinned) if not e.wait(0)), len(self.pinned)))
            self.copy()
        except Exception as err:  # never leave the future unresolved, nor a chunk pinned
            self.fail(err)
        finally:
            self.served.set()

    # -- either pass ----------------------------------------------------------------------
    def copy(self) -> None:
        """Submit the copy of ``pinned`` (all READY), or end the retrieve without one."""
        inst, good = self.inst, self.pinned
        if self.req_deadline is not None and self.req_deadline.passed():
            self.fail(DeadlineExceededError(
                "retrieve: its client's deadline passed before the copy could start; no byte was "
                "written into its blocks"
            ))  # fmt: skip  # the caller gave up: its blocks may belong to another request
            return
        if not good:
            self.end(CopyTally(), None)
            return
        ctx = inst.ctx
        sel = self.ids[: len(good) * ctx.blocks_per_chunk]
        try:
            chunks = [e.tensor for e in good]
            job = ctx.copy_from_chunks_async(
                chunks, sel, skip_blocks=self.local_skip, deadline=self.req_deadline
            )
        except Exception as err:  # the handler is closed: nothing was queued
            self.fail(err)
            return
        try:
            inst.completer.add(job, Direction.FROM_CHUNKS, self._copied)
        except Exception:  # the engine is closing: complete it here
            (result,) = ctx.transfer.wait([job])
            self._copied(result)

    def _cut(self, n: int) -> None:
        """Keep the first ``n`` pinned entries: the prefix ends there."""
        self.parts.pool.release(self.pinned[n:])
        self.pinned = self.pinned[:n]

    def fail(self, err: BaseException) -> None:
        self._cut(0)
        self.end(CopyTally(), err)

    # -- completer thread -----------------------------------------------------------------
    def _copied(self, result: TransferResult) -> None:
        copies = CopyTally()
        copies.add(result)
        good, self.pinned = self.pinned, []
        if result.error is not None:
            self.parts.pool.release(good)
            self.end(copies, result.error)
            return
        l2_tokens = sum(self.inst.ctx.chunk_size for e in good if e.from_l2)
        for e in good:
            e.from_l2 = False
        self.parts.pool.release(good, read_bytes=result.bytes)
        self.end(copies, None, l2_tokens)

    # -- whichever thread ends it ---------------------------------------------------------
    def end(self, copies: CopyTally, error: BaseException | None, l2_tokens: int = 0) -> None:
        """Publish the one ``MP_RETRIEVE_END`` and resolve the future."""
        parts, inst = self.parts, self.inst
        copied = copies.blocks * inst.ctx.block_size
        retrieved = self.skip + copied
        parts.stats.record_retrieve(copies.nbytes, copies.seconds, copied)
        parts.events.retrieve_end(
            inst, self.sid, self.num_tokens, self.skip, retrieved, max(0, copied - l2_tokens), l2_tokens,
            copies, error is None, self.await_upto,
        )  # fmt: skip
        if error is None:
            result = RetrieveResult(retrieved, num_bytes=copies.nbytes, transfer_seconds=copies.seconds)
            self.future.set_result(result)
        else:
            self.future.set_exception(error)


def _leading_ready(entries: Sequence[L1Entry]) -> tuple[int, bool]:
    """How many leading entries are READY, and whether the next one is still loading (a
    failed load, like a miss, ends the prefix and is waited for by nobody)."""
    for i, entry in enumerate(entries):
        if not entry.wait(0):
            return i, entry.ok
    return len(entries), False


__all__ = ["prefetch", "retrieve_async"]
