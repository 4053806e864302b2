"""Requests that need a prefix another request of this engine is loading wait for that load.

vLLM caches the blocks of an asynchronous load only once the load is reported done
(``delay_cache_blocks``), so N requests that arrive together sharing a prefix held by the
daemon would each be given blocks of their own and each load the same chunks: N copies of
the same bytes, made one after another, the last request's first token N copies late
(measured by ``python -m benchmarks.vllm_shared``). The scheduler half instead answers
"not known yet" (``None``) for a request whose next chunk another admitted request is loading
now; vLLM leaves it waiting, and once that load is reported done and vLLM cached its blocks,
the request finds the prefix in vLLM's own prefix cache and loads at most what lies beyond it.

The wait is bounded by the other request's load: a load ends, received or failed, and an
aborted request's load is still reported (vLLM holds its blocks until then), after which the
waiting request is asked again and loads for itself whatever vLLM did not cache. Only chunks
past the request's own computed tokens count, under the same scope (salt and ``key_extra``:
vLLM's block hashes cover both), so a request is never held back by a load it could not
share.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple


class _Loading(NamedTuple):
    tokens: Sequence[int]  # the prompt's leading tokens vLLM will hold once the load is done
    scope: tuple[str, str]  # (cache_salt, key_extra)


class SharedLoads:
    """The scheduler half's asynchronous loads in flight, by request, and who may share them."""

    def __init__(self) -> None:
        self._loading: dict[str, _Loading] = {}

    def started(self, request: Any, upto: int, key_extra: str) -> None:
        """``request`` was admitted with an asynchronous load: once it is done vLLM holds the
        prompt's first ``upto`` tokens."""
        prompt = request.prompt_token_ids or []
        self._loading[request.request_id] = _Loading(prompt[:upto], (request.cache_salt or "", key_extra))

    def ended(self, req_ids: Collection[str]) -> None:
        """Their loads were reported done (received or failed), or they finished."""
        for req_id in req_ids:
            self._loading.pop(req_id, None)

    def behind(self, request: Any, computed: int, chunk: int, key_extra: str) -> str | None:
        """The request whose load in flight covers the prompt's next ``chunk`` tokens past
        ``computed`` under the same scope, or None; ``request`` should wait for that one."""
        prompt = request.prompt_token_ids or []
        end = computed + chunk
        if end > len(prompt):
            return None
        want = list(prompt[computed:end])
        scope = (request.cache_salt or "", key_extra)
        for other, loading in self._loading.items():
            covers = other != request.request_id and loading.scope == scope and len(loading.tokens) >= end
            if covers and list(loading.tokens[computed:end]) == want:
                return other
        return None

    def __len__(self) -> int:
        return len(self._loading)


__all__ = ["SharedLoads"]
