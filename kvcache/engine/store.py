"""The store path: engine blocks -> fresh L1 slots, then written through to the L2 tiers that
admit them (``admission``).

Separate from the engine facade because it is the one path that reserves memory and owns the
write-through pins: each chunk newly written to L1 stays pinned once per tier until that tier's
write finishes (or is refused), so a slot is never evicted or reused while a tier reads it.

One pass down: the request (``request.StoreRequest``, checked when it was built) is keyed once
(``_StoreOp.begin``), the
slots L1 has room for now are reserved and their copies submitted on the caller's thread
(``_StoreOp.run``, which never waits), a store short of room is finished on the engine's store
waiter thread (``_StoreOp._wait_pass``, see ``waiter``), and each copy's ``TransferResult`` is
completed on the instance's completer thread (``_StoreOp._copied``): the entries become READY
(visible to lookups) only then, are written through, and the last completion publishes the end
event and resolves the caller's future.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvcache.deadline import Deadline
from kvcache.engine.admission import admitted_on_store
from kvcache.engine.alarms import Alarm
from kvcache.engine.instance import InstanceState
from kvcache.engine.op_events import chunk_identities, chunk_write_metadata
from kvcache.engine.parts import EngineParts
from kvcache.engine.records import CopyTally
from kvcache.engine.waiting import notify_settled
from kvcache.errors import DeadlineExceededError
from kvcache.futures import failed
from kvcache.observability.event import EventType, MpStoreStart
from kvcache.records import ChunkKey, StoreResult
from kvcache.request import StoreRequest
from kvcache.storage.l1.entry import L1Entry
from kvcache.storage.l2.async_front import AsyncL2
from kvcache.transfer.base import Direction, TransferResult


def store_async(parts: EngineParts, inst: InstanceState, req: StoreRequest) -> Future[StoreResult]:
    """See ``CacheEngine.submit_store``. Never raises: every error is set on the future.

    Chunks are reserved and their copies submitted in batches: when L1 runs out while this
    store holds fresh slots, it submits those first and then asks for the rest, so it only
    ever waits (within ``store_wait_timeout_s``, in all, on the engine's waiter thread)
    holding nothing it has not handed on. Without an L2 tier there is nothing to write
    through: it waits holding what it reserved, and the first shortage after the wait ends it.
    """
    try:
        op = _StoreOp.begin(parts, inst, req)
    except Exception as err:  # a bad request: nothing was reserved or published
        return failed(err)
    op.run()
    return op.future


@dataclass(eq=False)
class _StoreOp:
    """One store in flight. The caller's thread, then (if it was short of room) the waiter's,
    fill ``skipped``/``failed`` and submit, one after the other; the completer thread adds
    ``stored`` and the tally; ``lock`` guards the shared counts."""

    parts: EngineParts
    inst: InstanceState
    req: StoreRequest
    sid: str
    keys: list[ChunkKey]
    deadline: Deadline  # the end of any wait (``store_wait_timeout_s``, the request's deadline)
    future: Future[StoreResult] = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    tally: CopyTally = field(default_factory=CopyTally)
    stored: int = 0
    skipped: int = 0
    failed: int = 0
    pending: int = 1  # the submitting pass itself counts until it is over
    error: BaseException | None = None
    pos: int = 0  # keys before it are settled (reserved, present or failed)
    held: list[tuple[int, L1Entry]] = field(default_factory=list)  # reserved, not yet submitted
    keyed_tokens: int = 0  # tokens of a store keyed by the engine (``pages``): it has no token ids
    watching: dict[L1Entry, int] = field(default_factory=dict)  # loads it waits for (``_watch``)
    alarm: Alarm | None = None  # ends those waits at ``deadline``
    armed: bool = False  # that alarm is set (or being set)

    @classmethod
    def begin(cls, parts: EngineParts, inst: InstanceState, req: StoreRequest) -> _StoreOp:
        """Key the request once and publish ``MP_STORE_START``."""
        keys = inst.request_keys(req)
        sid = parts.events.session(inst.instance_id, req.request_id)
        deadline = Deadline.within(parts.config.store_wait_timeout_s).earliest(req.deadline)
        op = cls(parts, inst, req, sid, keys, deadline)
        start = inst.meta(MpStoreStart, num_tokens=len(req.token_ids), num_chunks=len(keys))
        parts.events.publish(EventType.MP_STORE_START, sid, start)
        return op

    # -- caller's thread ------------------------------------------------------------------
    def run(self) -> None:
        """Reserve what L1 has room for now and submit those copies, without waiting. A store
        short of room, or of an instance with a store waiting already (it must not take that
        one's room), is handed to the engine's waiter, whose pass settles it."""
        waiter, iid = self.parts.store_waiter, self.inst.instance_id
        handed = False
        try:
            handed = waiter.add(iid, self._wait_pass, only_behind=True)
            if not handed and self._reserve_and_submit(None):
                handed = waiter.add(iid, self._wait_pass)
        except Exception as err:  # never leave the future unresolved
            self._drop_held()
            self._fail(err)
        finally:
            if not handed:
                self._settle_one()

    # -- waiter's thread ------------------------------------------------------------------
    def _wait_pass(self, stop: threading.Event) -> None:
        """The rest of a store short of room: waits for it within the store's deadline, or
        not at all once ``stop`` is set (the engine or instance is closing)."""
        try:
            self._reserve_and_submit(stop)
        except Exception as err:  # never leave the future unresolved
            self._drop_held()
            self._fail(err)
        finally:
            self._settle_one()

    # -- either pass ----------------------------------------------------------------------
    def _reserve_and_submit(self, stop: threading.Event | None) -> bool:
        """Reserve and submit batch by batch from ``pos``. The caller's pass (``stop`` None)
        never waits: it returns True where the rest needs room that others hold (the slots it
        reserved without an L2 tier stay ``held`` until then: see ``L1Pool.begin_write``)."""
        parts, keys = self.parts, self.keys
        partial = bool(parts.tiers)
        while self.pos < len(keys) and self.error is None:
            waits = stop is not None and not stop.is_set()
            left = self.deadline.left() if waits else 0.0
            pool, pos = parts.pool, self.pos
            res = pool.begin_write(self.inst.slot_shape, keys[pos:], wait_s=left, partial=partial,
                                   defer=stop is None, held=len(self.held), stop=stop,
                                   tenant=self.inst.tenant)  # fmt: skip
            got = self.held + [(pos + i, e) for i, e in res.new]
            self.held = []
            new = [e for _, e in got]
            with self.lock:
                self.skipped += len(res.present)
                self.failed += res.failed
            gone = self.req.deadline is not None and self.req.deadline.passed()
            if gone and (new or res.failed):
                # The caller gave up (its blocks may hold another request's KV by now): copy
                # nothing more, and say why the rest is not stored.
                pool.finish(new, False)
                self._fail(
                    DeadlineExceededError(
                        f"store: its client's deadline passed before chunk {pos} could be copied; "
                        "the rest was not copied"
                    )
                )
                break
            if res.loading:
                self._watch([(pos + i, e) for i, e in res.loading])
            self.pos += res.settled
            short = stop is None and self.pos < len(keys)
            if short and not partial:  # no tier frees what it copies: keep the slots, wait
                self.held = got
                return True
            if new:
                self._submit([i for i, _ in got], new)
            if short:
                return True
        return False

    def _watch(self, loading: list[tuple[int, L1Entry]]) -> None:
        """Chunks an L2 prefetch was still loading when this store reserved: counted as
        skipped, yet the load may fail (a corrupt or lost L2 copy) and drop them, while this
        store's blocks hold their bytes. The store stays open until each has settled, at
        most until its own wait bound (``deadline``: an alarm ends the watch there, so a slow
        tier never holds a store longer than a wait for room would), and one whose load
        failed is reserved and copied again (``_retake``)."""
        if self.deadline.passed() or not self.inst.watch(self._stop_watching):
            return  # the watch is over (or about to be), or the instance leaving: they stay skipped
        with self.lock:
            fresh = {entry: i for i, entry in loading if entry not in self.watching}
            self.watching.update(fresh)
            self.pending += len(fresh)
            arm, self.armed = not self.armed, True
        if arm:  # not under the lock: closed alarms run ``_stop_watching`` (which takes it) here
            self.alarm = self.parts.alarms.at(self.deadline, self._stop_watching)
        self.parts.pool.on_settled(fresh, self._load_settled)

    def _load_settled(self, entry: L1Entry) -> None:
        """A watched load settled (on the thread that settled it: the tier's I/O worker, or
        a prefetch's caller): done, or retaken when it failed. The store's end is never run
        here: resolving runs the caller's done-callbacks, which must not run on an I/O
        thread (one that waits for L2, ``flush``, would wait for its own load). The last
        part left is settled on the store waiter, as a store that waited for room is."""
        with self.lock:
            i = self.watching.pop(entry, None)
            if i is None:  # the watch ended first (``_stop_watching``)
                return
            if not entry.ok:
                self.skipped -= 1
            elif self.pending > 1:  # not the last part: nothing resolves here
                self.pending -= 1
                return
        if entry.ok:  # the store's end, off this thread and behind no wait for room
            self.parts.alarms.soon(self._settle_one)
        else:
            self.parts.store_waiter.add(self.inst.instance_id, lambda stop: self._retake(i, stop))

    def _stop_watching(self) -> None:
        """The store's wait bound passed (its alarm), or its instance is leaving
        (``InstanceState.leave``): the loads still in flight stay counted as skipped,
        whatever they come to."""
        with self.lock:
            ended, self.watching = len(self.watching), {}
        for _ in range(ended):
            self._settle_one()

    def _retake(self, i: int, stop: threading.Event) -> None:
        """Chunk ``i``, whose L2 load failed: reserved (waiting for room within the store's
        bound, as any store pass) and copied, unless this store is over or its instance is
        leaving (``unregister`` waits for a retake running then, and none starts after)."""
        try:
            gone = self.req.deadline is not None and self.req.deadline.passed()
            if self.error is not None or gone or self.inst.leaving:  # its blocks may be gone
                with self.lock:
                    self.failed += 1
                return
            left = 0.0 if stop.is_set() else self.deadline.left()
            res = self.parts.pool.begin_write(
                self.inst.slot_shape, [self.keys[i]], wait_s=left, stop=stop, tenant=self.inst.tenant
            )
            new = [e for _, e in res.new]
            late = bool(new) and self.req.deadline is not None and self.req.deadline.passed()
            if late:  # it waited for room past its caller's deadline: the chunk is not copied
                self.parts.pool.finish(new, False)
            with self.lock:
                self.skipped += len(res.present)
                self.failed += res.failed + late
            if new and not late:
                self._submit([i], new)
            if res.loading:
                self._watch([(i, e) for _, e in res.loading])
        except Exception as err:  # never leave the future unresolved
            self._fail(err)
        finally:
            self._settle_one()

    def _drop_held(self) -> None:
        held, self.held = self.held, []
        self.parts.pool.finish([e for _, e in held], False)

    def _submit(self, indices: list[int], new: list[L1Entry]) -> None:
        bpc, req = self.inst.ctx.blocks_per_chunk, self.req
        if indices[-1] - indices[0] == len(indices) - 1:  # the usual case: one run of chunks
            sel = req.block_ids[indices[0] * bpc : (indices[-1] + 1) * bpc]
        else:
            sel = req.block_ids.runs([i * bpc for i in indices], bpc)
        ctx = self.inst.ctx
        try:
            chunks = [e.tensor for e in new]
            job = ctx.copy_to_chunks_async(sel, chunks, deadline=req.deadline, after=req.after)
        except Exception as err:  # the handler is closed: nothing was queued
            self.parts.pool.finish(new, False)
            self._fail(err)
            return
        with self.lock:
            self.pending += 1

        def done(result: TransferResult) -> None:
            self._copied(indices, new, result)

        try:
            self.inst.completer.add(job, Direction.TO_CHUNKS, done)
        except Exception:  # the engine is closing: complete it here
            (result,) = ctx.transfer.wait([job])
            done(result)

    # -- completer thread -----------------------------------------------------------------
    def _copied(self, indices: list[int], new: list[L1Entry], result: TransferResult) -> None:
        """One batch's copy finished: the chunks become READY (lookups see them from now
        on) and are written through, or their slots are freed when the copy failed."""
        parts = self.parts
        try:
            with self.lock:
                self.tally.add(result)
            if result.error is not None:
                parts.pool.finish(new, False)
                self._fail(result.error)
                return
            ctx = self.inst.ctx
            # Each tier's admission picks what it takes; the write-through pins (one per tier
            # that takes a chunk) are taken before the slots go public.
            plans = [(tier, admitted_on_store(tier, new, parts.events.bus)) for tier in parts.tiers]
            for _tier, taken in plans:
                parts.pool.pin(taken)
            cs = ctx.chunk_size
            bpc, bs = ctx.blocks_per_chunk, ctx.block_size
            tokens, hashes = self.req.token_ids.values, self.req.block_hashes
            extra = chunk_write_metadata(self.keys, indices, bpc, bs, cs, tokens, hashes)
            parts.pool.finish(new, True, extra)
            # a retrieve awaiting these chunks (``await_chunks``) looks again
            notify_settled(parts.loads_settled, [e.key for e in new], parts.waiting)
            with self.lock:
                self.stored += len(new)
            keep = any(tier.adapter.keeps_meta for tier in parts.tiers)
            metas = chunk_identities(extra, cs) if keep else []
            _write_through(parts, new, plans, self.deadline, metas)
        except Exception as err:  # never leave the future unresolved
            self._fail(err)
        finally:
            self._settle_one()

    # -- either thread --------------------------------------------------------------------
    def _fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is None:  # the first error is the one the caller sees
                self.error = err

    def _settle_one(self) -> None:
        """One submitted batch (or the submitting pass) is over; the last one reports."""
        with self.lock:
            self.pending -= 1
            if self.pending:
                return
            stored, skipped, failed, error = self.stored, self.skipped, self.failed, self.error
        if self.armed:
            self.inst.unwatch(self._stop_watching)
            if self.alarm is not None:
                self.alarm.cancel()
        parts, inst, cs = self.parts, self.inst, self.inst.ctx.chunk_size
        num_tokens = len(self.req.token_ids) or self.keyed_tokens
        if error is not None:  # earlier batches stay stored; the rest of the request is lost
            failed = len(self.keys) - stored - skipped
        tally = self.tally
        result = StoreResult(stored, skipped, failed, stored * cs, tally.nbytes, tally.seconds)
        parts.stats.record_store(tally.nbytes, tally.seconds, tally.blocks * inst.ctx.block_size)
        hashes = self.req.block_hashes if error is None else None
        parts.events.store_end(inst, self.sid, num_tokens, result, tally, error is None, hashes)
        if error is None:
            self.future.set_result(result)
        else:
            self.future.set_exception(error)


def _write_through(
    parts: EngineParts,
    entries: list[L1Entry],
    plans: list[tuple[AsyncL2, list[L1Entry]]],
    deadline: Deadline,
    metas: list[bytes],
) -> None:
    """Queue each tier the chunks its admission took (``plans``, pinned once per tier); a
    busy tier gets until ``deadline`` (the store's own wait bound) to make room, so a burst
    of stores is slowed down rather than dropped. ``metas`` (aligned with ``entries``, or
    empty) go to the tiers that keep them; each chunk is written on behalf of its tenant
    (the disk tier charges it to that tenant's share)."""
    index = {id(e): i for i, e in enumerate(entries)} if metas else {}
    for tier, taken in plans:
        for entry in taken:

            def done(ok: bool, entry: L1Entry = entry) -> None:
                parts.pool.release([entry])

            wait_s = deadline.left()
            meta = metas[index[id(entry)]] if metas and tier.adapter.keeps_meta else b""
            if not tier.submit_store(entry.key, entry.tensor, done, wait_s, meta, entry.tenant):
                parts.pool.release([entry])


__all__ = ["store_async"]
