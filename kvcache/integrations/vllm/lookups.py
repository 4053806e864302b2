"""The scheduler half's lookups: one round trip for the requests a step may admit.

Separate from the connector because it is one piece of state with one rule: a request is
looked up at most once per admission, and the lookups of requests vLLM added (or preempted)
since the last one travel together in one ``LookupBatch`` (``lookup_batch`` items at most);
their answers wait here until vLLM asks about each.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import Any

from kvcache.client import KVCacheClient
from kvcache.errors import ProtocolError
from kvcache.integrations.vllm.config import ConnectorConfig
from kvcache.integrations.vllm.request_keys import request_key_extra
from kvcache.integrations.vllm.stats import ConnectorTally
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids, with_heads

log = logging.getLogger("kvcache.integrations.vllm")


class StepLookups:
    """Lookups of one scheduler half; ``recompute``: the connector's requests whose
    asynchronous load vLLM dropped (``dropped_loads``: not looked up before their next admission)."""

    def __init__(
        self, client: KVCacheClient, tally: ConnectorTally, config: ConnectorConfig, recompute: Container[str]
    ) -> None:
        self.client, self.tally, self.config, self._recompute = client, tally, config, recompute
        self._unasked: dict[str, Any] = {}  # added or preempted, not looked up since (arrival order)
        self._answered: dict[str, tuple[int, m.LookupHit]] = {}  # in another's batch: (step, hit)
        self._last: dict[str, tuple[int, int, m.LookupHit]] = {}  # this admission's: (local, step, hit)
        self._batching = config.lookup_batch > 1

    def waiting(self, request: Any) -> None:
        """A request vLLM added or preempted: its lookup may travel with the next one asked."""
        if self._batching and self.config.load:
            self._unasked[request.request_id] = request

    def asked(self, req_id: str) -> None:
        self._unasked.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._unasked.pop(req_id, None)
        self._answered.pop(req_id, None)
        self._last.pop(req_id, None)

    def hit(
        self, request: Any, prompt: Any, key_extra: str, chunk_size: int, local: int, step: int
    ) -> tuple[m.LookupHit, bool]:
        """The daemon's hit for ``request`` beyond ``local`` tokens of vLLM's own, and whether
        it was asked in this scheduler step (``step``: the connector's count of plans built;
        an older answer's split between L1 and L2 may have changed since). Asked once per
        admission (vLLM asks again while the request waits for memory): from an earlier
        request's batch if one took it along, else now."""
        req_id = request.request_id
        last = self._last.get(req_id)
        if last is not None and last[0] == local:
            return last[2], last[1] == step
        asked, found = self._answered.pop(req_id, None) or (step, None)
        if found is None:
            found = self.lookup(request, prompt, key_extra, chunk_size, step)
        self._last[req_id] = (local, asked, found)
        return found, asked == step

    def admitted(self, req_id: str, local: int) -> int:
        """vLLM admitted ``req_id``: its local hit when it was asked (``local`` if never), and
        its next admission asks again."""
        last = self._last.pop(req_id, None)
        return last[0] if last is not None else local

    def lookup(self, request: Any, prompt: Any, key_extra: str, chunk_size: int, step: int) -> m.LookupHit:
        """The daemon's hit for ``request``, asked in one round trip together with requests
        added (or preempted) since and not asked about yet, up to ``lookup_batch``; their
        answers wait in ``_answered``, stamped with ``step``, for vLLM to ask about them (once
        per admission).

        NOTE: vLLM 0.32 asks per request (``get_num_new_matched_tokens``), in queue order, and
        only for the requests it tries to admit in this step; it has no hook before that loop.
        So the batch is made at the first ask of a step, from what ``on_new_request`` and the
        preemptions told us. A request batched here and not admitted in this step keeps its
        answer (and the daemon's prefetch of it) for its turn; one that vLLM's own prefix
        cache covers is asked about needlessly (its local hit is known only at its turn)."""
        salt = request.cache_salt or ""
        if not self._batching:
            found = self.client.lookup_tiers(prompt, cache_salt=salt, request_id=request.request_id,
                                             key_extra=key_extra)  # fmt: skip
            self.tally.lookup(len(prompt), found.hit_tokens, found.l2_hit_tokens)
            return m.LookupHit(found.hit_tokens, found.l2_hit_tokens)
        batch = [(request, prompt, salt, key_extra)]
        for req_id, other in list(self._unasked.items()):
            if len(batch) >= self.config.lookup_batch:
                break
            del self._unasked[req_id]
            tokens = other.prompt_token_ids
            extra = request_key_extra(other)
            if tokens is None or len(tokens) <= chunk_size or extra is None or req_id in self._recompute:
                continue  # never looked up (see get_num_new_matched_tokens)
            batch.append((other, tokens, other.cache_salt or "", extra))
        items = with_heads(  # a system prompt the step's requests share travels once
            [
                m.LookupItem(token_ids=pack_ids(t), cache_salt=s, request_id=r.request_id, key_extra=k)
                for r, t, s, k in batch
            ],
            chunk_size,
        )
        try:
            hits = self.client.lookup_batch(items)
        except ProtocolError as exc:  # a daemon from before LookupBatch: one lookup per request
            log.info("kvcache: the daemon does not take batched lookups (%s); asking one at a time", exc)
            self._batching = False
            self._unasked.clear()
            return self.lookup(request, prompt, key_extra, chunk_size, step)
        except Exception:
            for r, *_ in batch[1:]:  # asked again with a later request
                self._unasked[r.request_id] = r
            raise
        for (r, t, *_), hit in zip(batch, hits, strict=True):
            self.tally.lookup(len(t), hit.hit_tokens, hit.l2_hit_tokens)
            if r is not request:
                self._answered[r.request_id] = (step, hit)
        return hits[0]


__all__ = ["StepLookups"]
