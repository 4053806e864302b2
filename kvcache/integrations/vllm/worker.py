"""Worker side: register vLLM's KV tensors with the daemon, run a step's loads and stores.

No vLLM import: it takes the tensors and a ``StepPlan`` and talks to the daemon through
``KVCacheClient``. Loads finish in ``start_load_kv`` (a synchronous one before the forward
reads the blocks; an asynchronous one, under async scheduling, for a request vLLM computes
only after it is reported done); stores are synchronous too, at the end of the step, because
vLLM may hand the blocks to another request as soon as the step's output is processed.

Failures never stop the engine, and never poison the cache: a load that returns fewer
tokens than planned reports the blocks it did not fill (vLLM recomputes them). Those blocks,
and everything computed on top of them, are garbage until vLLM has recomputed them, so every
store stops before the chunk holding the first of them: the loading request's, and any other
request's that shares them through vLLM's prefix cache. They stay marked until a plan built
after vLLM processed the failure (``StepPlan.failures_seen``): under async scheduling the next
step was planned before (and, after a synchronous load, computes on them too). Whatever the
plan counted as stored but was not (cut this way, or a store that failed) is handed back to
the scheduler (``take_not_stored``) so a later step stores the right bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from kvcache.client import KVCacheClient
from kvcache.errors import KvcacheError
from kvcache.integrations.vllm.plan import StepPlan
from kvcache.integrations.vllm.stats import ConnectorTally
from kvcache.layouts import GPUKVFormat

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


class ConnectorWorker:
    """One tensor-parallel rank's half of the connector."""

    def __init__(
        self, client: KVCacheClient, block_size: int, kv_format: str | None = None, chunk_size: int = 0
    ) -> None:
        self.client = client
        self.block_size = block_size
        self.chunk_size = chunk_size or block_size
        """Set from the daemon's reply at registration."""
        self.kv_format = kv_format
        self.registered = False
        self.tally = ConnectorTally()
        """What this rank loaded and stored: vLLM's connector stats (``metrics.py``)."""
        self.bytes_per_token = 0
        """KV bytes one token occupies on this rank (all layers), set at registration."""
        self._load_errors: set[int] = set()
        # block id -> (the step whose load left it unfilled, whether that step computed on it)
        self._unfilled: dict[int, tuple[int, bool]] = {}
        self._finished_recving: set[str] = set()
        self._failed_step = -1  # the last step with a failed load, not yet reported
        self._not_stored: dict[str, int] = {}  # req -> tokens really stored (a watermark)
        self._finished_sending: set[str] = set()

    def begin_step(self, plan: StepPlan) -> None:
        """Forget the blocks of failed loads that vLLM recomputes from this plan on."""
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
            fmt = GPUKVFormat.NL_X_NB_PAGE.name
        reply = self.client.register_kv_caches(layers, engine="vllm", block_size=self.block_size, fmt=fmt)
        self.chunk_size = reply.chunk_size
        self.bytes_per_token = sum(t.nbytes for t in layers) // max(1, reply.num_blocks * reply.block_size)
        self.registered = True
        log.info(
            "kvcache: registered %d layers x %d blocks of %d tokens as %s (chunk %d tokens)",
            reply.num_layers, reply.num_blocks, reply.block_size, reply.fmt, reply.chunk_size,
        )  # fmt: skip

    def load(self, plan: StepPlan) -> None:
        """Copy the planned prefixes in; whatever did not arrive is reported as load errors
        (vLLM recomputes it), including every load of a rank that could not register (the
        scheduler half may still find prefixes through another rank's registration)."""
        for spec in plan.loads:
            want = len(spec.token_ids)
            t0 = time.perf_counter()
            if spec.is_async:
                self._finished_recving.add(spec.req_id)  # done, whatever the outcome
            try:
                if not self.registered:
                    raise KvcacheError("this rank's KV cache is not registered with the daemon")
                got = self.client.retrieve(
                    spec.token_ids,
                    spec.block_ids,
                    spec.skip_tokens,
                    cache_salt=spec.cache_salt,
                    request_id=spec.req_id,
                    key_extra=spec.key_extra,
                )
            except Exception as exc:  # the daemon is down or refused: recompute instead
                log.warning("kvcache: load for %s failed: %s", spec.req_id, exc)
                got = spec.skip_tokens
            loaded = max(0, got - spec.skip_tokens)
            self.tally.transfer("load", loaded, loaded * self.bytes_per_token,
                                time.perf_counter() - t0, ok=got >= want)  # fmt: skip
            if got < want:
                first_bad = max(got, spec.skip_tokens) // self.block_size
                self._load_errors.update(spec.block_ids[first_bad:])
                self._unfilled.update((b, (plan.step, not spec.is_async)) for b in spec.block_ids[first_bad:])
                self._failed_step = plan.step
                self._not_stored[spec.req_id] = min(
                    self._not_stored.get(spec.req_id, 1 << 62), self._chunk_floor(first_bad)
                )
                log.warning(
                    "kvcache: loaded %d of %d tokens for %s; vLLM recomputes the rest",
                    got, want, spec.req_id,
                )  # fmt: skip

    def store(self, plan: StepPlan) -> None:
        for spec in plan.stores:
            if spec.final:
                self._finished_sending.add(spec.req_id)  # released even if the store fails
            token_ids, block_ids = spec.token_ids, spec.block_ids
            bad = next((i for i, b in enumerate(block_ids) if b in self._unfilled), None)
            if bad is not None:
                # Blocks from ``bad`` on hold garbage, or were computed on it: store only the
                # whole chunks before the first of them.
                keep = self._chunk_floor(bad)
                self.tally.count("stores_poisoned")
                self._mark_not_stored(spec.req_id, keep)
                if keep == 0:
                    continue
                token_ids, block_ids = token_ids[:keep], block_ids[: keep // self.block_size]
            t0 = time.perf_counter()
            try:
                result = self.client.store(
                    token_ids,
                    block_ids,
                    cache_salt=spec.cache_salt,
                    request_id=spec.req_id,
                    block_hashes=None if spec.block_hashes is None else spec.block_hashes[: len(block_ids)],
                    key_extra=spec.key_extra,
                )
            except Exception as exc:  # a dropped store is a later miss, never a wrong answer
                self.tally.transfer("store", 0, 0, time.perf_counter() - t0, ok=False)
                self._mark_not_stored(spec.req_id, spec.stored_before)
                log.warning("kvcache: store for %s failed: %s", spec.req_id, exc)
                continue
            # Bytes copied: every chunk not already cached (stored_tokens counts new tokens).
            self.tally.transfer("store", result.stored_tokens, result.stored_tokens * self.bytes_per_token,
                                time.perf_counter() - t0)  # fmt: skip
            if result.failed_chunks:  # the daemon dropped some (memory): store them later
                self._mark_not_stored(spec.req_id, len(token_ids) - result.failed_chunks * self.chunk_size)

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

    def take_load_errors(self) -> set[int]:
        """This step's unfilled blocks, and those of earlier steps vLLM had not processed
        when it planned this one (async scheduling): this step computed on them too, and
        reporting them again makes vLLM discard what it computed instead of keeping a token
        sampled from garbage."""
        recomputing = {b for b, (_, computed_on) in self._unfilled.items() if computed_on}
        errors, self._load_errors = self._load_errors | recomputing, set()
        return errors

    def take_failed_step(self) -> int:
        """The last step whose load failed since the previous call, or -1."""
        step, self._failed_step = self._failed_step, -1
        return step

    def take_finished_recving(self) -> set[str]:
        """Requests whose asynchronous load ran this step (failed blocks are load errors)."""
        done, self._finished_recving = self._finished_recving, set()
        return done

    def take_finished_sending(self) -> set[str]:
        """Finished requests whose final store is done (or given up): vLLM frees their blocks."""
        done, self._finished_sending = self._finished_sending, set()
        return done

    def close(self) -> None:
        self.client.close()


__all__ = ["ConnectorWorker", "unique_layers"]
