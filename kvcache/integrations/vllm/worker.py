"""Worker side: register vLLM's KV tensors with the daemon, run a step's retrieves and stores.

No vLLM import: it takes the tensors and a ``StepPlan`` and talks to the daemon through
``KVCacheClient``. A synchronous retrieve is done in ``retrieve``, before the forward that reads its
blocks. An asynchronous one is only issued there (``RetrievesInFlight`` holds it): its request
waits in vLLM (``WAITING_FOR_REMOTE_KVS``) and is reported received (``take_finished_recving``)
in the first step that finds the copy settled, with the blocks it did not fill among that
same step's retrieve errors, so vLLM truncates the request before it schedules it. Until then
vLLM touches none of its blocks, not even when the request is aborted: vLLM 0.32 keeps an
aborted request's blocks while its retrieve is unreported, and frees them when it is reported.
Stores are issued at the end of the step (``store``) and, by default, not waited for: the
daemon copies while vLLM schedules and computes the next steps. vLLM must not hand a block
to another request before the daemon has copied it (the store would cache the other
request's bytes), so a finished request is reported sent
(``take_finished_sending``, vLLM then frees its blocks) only once every store of its blocks
is settled, and a preempted request's stores (and retrieves, though vLLM never preempts a
request it has not been told has arrived) are waited for before the step's forward can write
into its old blocks (``begin_step``, from vLLM's ``handle_preemptions``). With
``async_stores=False`` every store is waited for in ``store`` (the blocks are copied before
the step's output is processed).

NOTE: an asynchronous store reads the blocks whenever the daemon handles it, so nothing may
write them in place before: vLLM writes only slots of tokens not yet computed, except when it
recomputes the blocks a failed retrieve left unfilled, and those are cut from every store (below).

Failures never stop the engine, and never poison the cache: a retrieve that returns fewer
tokens than planned reports the blocks it did not fill (vLLM recomputes them). Those blocks,
and everything computed on top of them, are garbage until vLLM has recomputed them, so every
store stops before the chunk holding the first of them: the retrieving request's, and any other
request's that shares them through vLLM's prefix cache. They stay marked until a plan built
after vLLM processed the failure (``StepPlan.failures_seen``): under async scheduling the next
step was planned before (and, after a synchronous retrieve, computes on them too). A failure is
the step's that reports it, not the step's that issued the retrieve: an asynchronous retrieve seen
failed steps after it was issued is unknown to every plan built before that report reached
vLLM. Whatever the plan counted as stored but was not (cut this way, or a store that failed) is handed back to
the scheduler (``take_not_stored``) so a later step stores the right bytes.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvcache.client import KVCacheClient
from kvcache.errors import KvcacheError
from kvcache.integrations.vllm.group_transfers import GroupTransfers
from kvcache.integrations.vllm.plan import RetrieveSpec, StepPlan, StoreSpec
from kvcache.integrations.vllm.retrieves import RetrievesInFlight, SettledRetrieve, retrieved
from kvcache.integrations.vllm.stats import ConnectorTally
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m

log = logging.getLogger("kvcache.integrations.vllm")


def unique_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The KV tensors in layer order, each once (layers sharing a cache appear once)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for tensor in kv_caches.values():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out.append(tensor)
    return out


@dataclass(slots=True)
class _InFlight:
    """A store issued and not yet settled (its reply or its failure not yet processed)."""

    spec: StoreSpec
    tokens: int
    """Tokens sent (the spec's, or fewer when cut before unfilled blocks)."""
    future: Future[m.StoreResult]


class ConnectorWorker:
    """One tensor-parallel rank's half of the connector, called from vLLM's model-runner
    thread only (the client resolves store futures on its own thread; they are read here)."""

    def __init__(
        self,
        client: KVCacheClient,
        block_size: int,
        kv_format: str | None = None,
        chunk_size: int = 0,
        *,
        async_stores: bool = True,
    ) -> None:
        self.client = client
        self.async_stores = async_stores
        """Issue stores without waiting for them (``store_async``); see the module docstring."""
        self.block_size = block_size
        self.chunk_size = chunk_size or block_size
        """Set from the daemon's reply at registration."""
        self.kv_format = kv_format
        self.registered = False
        self.tally = ConnectorTally()
        """What this rank retrieved and stored: vLLM's connector stats (``metrics.py``)."""
        self._retrieve_errors: set[int] = set()
        # block id -> (the step whose retrieve left it unfilled, whether that step computed on it)
        self._unfilled: dict[int, tuple[int, bool]] = {}
        self._finished_recving: set[str] = set()
        self._failed_step = -1  # the last step with a failed retrieve, not yet reported
        self._failed_async: set[str] = set()  # requests whose asynchronous retrieve failed, unreported
        self._not_stored: dict[str, int] = {}  # req -> tokens really stored (a watermark)
        self._finished_sending: set[str] = set()
        self._in_flight: dict[str, list[_InFlight]] = {}  # req -> its stores not settled yet
        self._releasing: set[str] = set()  # finished requests whose blocks vLLM holds for us
        self._retrieves = RetrievesInFlight()
        self.groups: GroupTransfers | None = None  # a hybrid model's page groups
        self._failed_recving: set[str] = set()  # hybrid: failed loads, for vLLM's failed_recving
        self._plan: StepPlan | None = None  # the plan of the step begun last
        self._step = 0  # its number: retrieve failures seen from now on are this step's

    def begin_step(self, plan: StepPlan) -> None:
        """Wait for the stores and retrieves of requests vLLM preempted for this step (it freed
        their blocks and may hand them to this step's retrieves and forward); forget the blocks of
        failed retrieves that vLLM recomputes from this plan on. Once per plan: vLLM calls it
        before the forward (``handle_preemptions``) and the connector again from
        ``start_load_kv``, which runs after the forward in a step without synchronous retrieves."""
        if plan is self._plan:
            return
        self._plan, self._step = plan, plan.step
        if self.groups is not None:  # vLLM may free or rewrite their blocks from now on
            self.groups.wait_stores()
        for req_id in plan.preempted:
            self._wait(self._in_flight.get(req_id, []), None)
            self._retrieves.wait([req_id], None)
        if self._unfilled:
            self._unfilled = {b: v for b, v in self._unfilled.items() if v[0] > plan.failures_seen}

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        layers = unique_layers(kv_caches)
        if not layers:
            raise KvcacheError("vLLM handed the connector no KV cache tensors")
        fmt = self.kv_format
        if fmt is None and layers[0].device.type == "cpu":
            # vLLM's CPU layout packs K (transposed) and V in each (block, head) tile: copy
            # each layer's block as one opaque page.
            fmt = KVFormat.NL_X_NB_PAGE.name
        reply = self.client.register_kv_caches(layers, engine="vllm", block_size=self.block_size, fmt=fmt)
        self.chunk_size = reply.chunk_size
        self.registered = True
        log.info(
            "kvcache: registered %d layers x %d blocks of %d tokens as %s (chunk %d tokens)",
            reply.num_layers, reply.num_blocks, reply.block_size, reply.fmt, reply.chunk_size,
        )  # fmt: skip

    def retrieve(self, plan: StepPlan) -> None:
        """Copy the planned prefixes in: a synchronous retrieve before returning, an asynchronous
        one only issued (settled by ``take_finished_recving`` / ``take_retrieve_errors``). What
        did not arrive is reported as retrieve errors (vLLM recomputes it), including every retrieve
        of a rank that could not register (the scheduler half may still find prefixes through
        another rank's registration)."""
        for spec in plan.retrieves:
            if spec.is_async:
                self._retrieves.add(spec, self._retrieve_async(spec))
                continue
            try:  # on the caller's channel: not queued behind the stores in flight
                if not self.registered:
                    raise KvcacheError("this rank's KV cache is not registered with the daemon")
                reply = self.client.retrieve_reply(
                    spec.token_ids, spec.block_ids, spec.skip_tokens,
                    cache_salt=spec.cache_salt, request_id=spec.req_id, key_extra=spec.key_extra,
                )  # fmt: skip
                settled = retrieved(spec, reply)
            except Exception as exc:  # the daemon is down or refused: recompute instead
                settled = SettledRetrieve(spec, spec.skip_tokens, exc)
            self._retrieved(settled, plan.step, True)

    def _retrieve_async(self, spec: RetrieveSpec) -> Future[m.RetrieveResult]:
        """The retrieve's future (the daemon's whole reply: it carries the copy's bytes and
        seconds); one that could not be issued is already failed."""
        try:
            if not self.registered:
                raise KvcacheError("this rank's KV cache is not registered with the daemon")
            future = self.client.retrieve_reply_async(
                spec.token_ids, spec.block_ids, spec.skip_tokens,
                cache_salt=spec.cache_salt, request_id=spec.req_id, key_extra=spec.key_extra,
                awaited=spec.awaited[:2],
            )  # fmt: skip
            return self.groups.combined(spec.skip_tokens, future, spec.pages) if self.groups else future
        except Exception as exc:
            failed: Future[m.RetrieveResult] = Future()
            failed.set_exception(exc)
            return failed

    def _retrieved(self, retrieve: SettledRetrieve, step: int, computed_on: bool) -> None:
        """Count a finished retrieve; mark what it did not fill as ``step``'s failure (retrieve errors,
        unfilled blocks cut from stores, the scheduler's watermark lowered). ``computed_on``:
        that step's forward read the blocks (a synchronous retrieve)."""
        spec, got = retrieve.spec, retrieve.got
        want = len(spec.token_ids)
        copied = max(0, got - spec.skip_tokens)
        # "load": the tally's keys are vLLM's offload metric names (vllm:kv_offload_load_*).
        self.tally.transfer("load", copied, retrieve.num_bytes, retrieve.seconds, ok=got >= want)
        if spec.awaited[0]:  # a decode request: what the prefill instance's store did not bring
            self.tally.count("transfer_missed_tokens", max(0, min(want, spec.awaited[2]) - got))
        if retrieve.error is not None:
            log.warning("kvcache: retrieve for %s failed: %s", spec.req_id, retrieve.error)
        if got >= want:
            return
        if self.groups is not None:  # no block ids with several groups: recomputed whole, no reload
            self._failed_recving.add(spec.req_id)
            self._failed_async.add(spec.req_id)
            self._mark_not_stored(spec.req_id, 0)
            return
        first_bad = max(got, spec.skip_tokens) // self.block_size
        self._retrieve_errors.update(spec.block_ids[first_bad:])
        self._unfilled.update((b, (step, computed_on)) for b in spec.block_ids[first_bad:])
        self._failed_step = max(self._failed_step, step)
        if spec.is_async:
            self._failed_async.add(spec.req_id)
        self._mark_not_stored(spec.req_id, self._chunk_floor(first_bad))
        log.warning(
            "kvcache: retrieved %d of %d tokens for %s; vLLM recomputes the rest", got, want, spec.req_id
        )

    def _settle_retrieves(self) -> None:
        """Take in every asynchronous retrieve that has settled: its failures are this step's,
        and its request is reported received once it has no retrieve left in flight."""
        settled, done = self._retrieves.settled()
        for retrieve in settled:
            self._retrieved(retrieve, self._step, False)  # vLLM computes on them only once told
        self._finished_recving |= done

    def wait_retrieves(self, timeout_s: float | None) -> bool:
        """Wait (at most ``timeout_s``; None: until each retrieve's own deadline) until no
        asynchronous retrieve is in flight; True if none is. They are reported by the next
        ``take_finished_recving``."""
        return self._retrieves.wait(None, timeout_s)

    @property
    def retrieves_in_flight(self) -> int:
        """Asynchronous retrieves issued whose copy has not settled yet."""
        return len(self._retrieves)

    def store(self, plan: StepPlan) -> None:
        """Issue the plan's stores; in synchronous mode, wait for them too."""
        for spec in plan.stores:
            if spec.final:
                self._releasing.add(spec.req_id)  # released even if the store fails
            token_ids, block_ids = spec.token_ids, spec.block_ids
            bad = next((i for i, b in enumerate(block_ids) if b in self._unfilled), None)
            if bad is not None:
                # Blocks from ``bad`` on hold garbage, or were computed on it: store only the
                # whole chunks before the first of them.
                keep = self._chunk_floor(bad)
                self.tally.count("stores_poisoned")
                self._mark_not_stored(spec.req_id, keep)
                token_ids, block_ids = token_ids[:keep], block_ids[: keep // self.block_size]
            if not token_ids:  # nothing to copy (cut to nothing, or a release marker)
                continue
            hashes = None if spec.block_hashes is None else spec.block_hashes[: len(block_ids)]
            future: Future[m.StoreResult] = Future()
            try:
                if self.async_stores:
                    future = self.client.store_async(
                        token_ids, block_ids, cache_salt=spec.cache_salt, request_id=spec.req_id,
                        block_hashes=hashes, key_extra=spec.key_extra,
                    )  # fmt: skip
                else:
                    future.set_result(self.client.store(
                        token_ids, block_ids, cache_salt=spec.cache_salt, request_id=spec.req_id,
                        block_hashes=hashes, key_extra=spec.key_extra,
                    ))  # fmt: skip
            except Exception as exc:  # settled as a failed store
                future.set_exception(exc)
            self.tally.count("store_jobs_issued")
            self._in_flight.setdefault(spec.req_id, []).append(_InFlight(spec, len(token_ids), future))
        if self.groups is not None:
            self.groups.store(plan.page_stores)
        self.poll()

    def poll(self) -> None:
        """Settle every store whose reply (or failure) has arrived; move finished requests with
        no store left in flight to ``take_finished_sending``."""
        for req_id in list(self._in_flight):
            stores = self._in_flight[req_id]
            pending = [s for s in stores if not s.future.done()]
            for store in stores:
                if store.future.done():
                    self._settle(store)
            if pending:
                self._in_flight[req_id] = pending
            else:
                del self._in_flight[req_id]
        done = {r for r in self._releasing if r not in self._in_flight}
        self._releasing -= done
        self._finished_sending |= done

    def wait_stores(self, timeout_s: float | None) -> bool:
        """Wait (at most ``timeout_s``; None: until each store's own deadline has passed,
        the client bounds every call) for every store in flight, then ``poll``. True if none
        is left in flight."""
        self._wait([s for stores in self._in_flight.values() for s in stores], timeout_s)
        self.poll()
        return not self._in_flight

    def _wait(self, stores: list[_InFlight], timeout_s: float | None) -> None:
        if stores:
            concurrent.futures.wait([s.future for s in stores], timeout=timeout_s)

    def _settle(self, store: _InFlight) -> None:
        """Count a finished store; hand back what it did not store (``take_not_stored``)."""
        spec = store.spec
        self.tally.count("store_jobs_settled")
        try:
            result = store.future.result()
        except Exception as exc:  # a dropped store is a later miss, never a wrong answer
            self.tally.transfer("store", 0, 0, 0.0, ok=False)
            self._mark_not_stored(spec.req_id, spec.stored_before)
            log.warning("kvcache: store for %s failed: %s", spec.req_id, exc)
            return
        # The daemon's own copy figures (its TransferResult records): bytes of the chunks not
        # already cached, and the copies' time, not the time the store waited in queues.
        self.tally.transfer("store", result.stored_tokens, result.num_bytes, result.transfer_seconds)
        if result.failed_chunks:  # the daemon dropped some (memory): store them later
            self._mark_not_stored(spec.req_id, store.tokens - result.failed_chunks * self.chunk_size)

    def _chunk_floor(self, blocks: int) -> int:
        """Tokens of the whole chunks that fit in the first ``blocks`` blocks."""
        return blocks * self.block_size // self.chunk_size * self.chunk_size

    def _mark_not_stored(self, req_id: str, stored_upto: int) -> None:
        self._not_stored[req_id] = min(self._not_stored.get(req_id, 1 << 62), max(0, stored_upto))

    def take_not_stored(self) -> dict[str, int]:
        """Per request, the token count up to which its chunks really are stored, when lower
        than the scheduler's plan assumed (it lowers its watermark to this)."""
        out, self._not_stored = self._not_stored, {}
        return out

    def take_retrieve_errors(self) -> set[int]:
        """This step's unfilled blocks, and those of earlier steps vLLM had not processed
        when it planned this one (async scheduling): this step computed on them too, and
        reporting them again makes vLLM discard what it computed instead of keeping a token
        sampled from garbage.

        NOTE: an asynchronous retrieve's unfilled blocks must reach vLLM no later than its request's
        ``finished_recving``. Both this and ``take_finished_recving`` take in settled retrieves,
        and a retrieve taken in is in both sets from then on: whichever vLLM asks first, the
        errors are never reported in a later output than the request (vLLM's worker asks for
        ``get_finished`` first, then the retrieve errors, in the same pass)."""
        self._settle_retrieves()
        recomputing = {b for b, (_, computed_on) in self._unfilled.items() if computed_on}
        errors, self._retrieve_errors = self._retrieve_errors | recomputing, set()
        return errors

    def take_failed_recving(self) -> set[str]:
        """Hybrid model: requests whose load failed, taken in with ``take_finished_recving``'s."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    def take_failed_step(self) -> int:
        """The last step whose retrieve failed since the previous call, or -1."""
        step, self._failed_step = self._failed_step, -1
        return step

    def take_failed_async(self) -> frozenset[str]:
        """Requests whose asynchronous retrieve failed since the previous call. A settled retrieve is
        taken in by ``take_finished_recving`` or ``take_retrieve_errors``, both called before this
        in vLLM's pass, so a request is named here in the output that reports it received."""
        out, self._failed_async = frozenset(self._failed_async), set()
        return out

    def take_finished_recving(self, idle_wait_s: float = 0.0) -> set[str]:
        """Requests whose asynchronous retrieves have all settled (failed blocks are retrieve errors
        of this step or an earlier one). ``idle_wait_s``: in a step with no forward, wait that
        long at most for the first retrieve in flight to settle if none has.

        NOTE: without that wait a lone retrieving request reaches its first token about twice as
        late as with a synchronous retrieve: vLLM steps again at once while nothing is scheduled,
        and its loop holds the GIL that the client's thread needs to receive the reply."""
        self._settle_retrieves()
        if idle_wait_s > 0 and not self._finished_recving and self._retrieves:
            self._retrieves.wait(None, idle_wait_s, first=True)
            self._settle_retrieves()
        done, self._finished_recving = self._finished_recving, set()
        return done

    def take_finished_sending(self) -> set[str]:
        """Finished requests whose stores are all settled (done or given up): vLLM frees
        their blocks."""
        self.poll()
        done, self._finished_sending = self._finished_sending, set()
        return done

    def close(self) -> None:
        self.client.close()


__all__ = ["ConnectorWorker", "unique_layers"]
