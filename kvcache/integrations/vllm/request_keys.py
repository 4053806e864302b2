"""What besides its tokens decides a vLLM request's KV, as a string kvcache keys chunks by.

vLLM's own block hashes add the LoRA adapter, the multimodal inputs overlapping a block (hash
and offset) and prompt-embedding hashes to the tokens (``vllm/v1/core/kv_cache_utils.py``).
Those hashes are seeded per process, so they cannot be the key other engines find chunks by;
instead the same facts go into the ``key_extra`` of every lookup, store and retrieve.

Per request, not per chunk: a request with an image keys all its chunks by all its images,
so its text-only prefix is not shared with text-only requests (fewer hits, never a wrong
one). A request kvcache cannot key faithfully returns None: it is neither looked up nor
stored. No vLLM import: the request is read by attribute, so this is testable on its own.
"""

from __future__ import annotations

from typing import Any

from kvcache.records import MAX_NAME


def request_key_extra(request: Any) -> str | None:
    """The ``key_extra`` for ``request``; "" for a plain token prompt; None when the request
    cannot be keyed faithfully (prompt embeddings: the KV depends on vectors, not tokens), or
    named to the daemon (an id or a cache salt longer than it takes)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    if len(request.request_id) > MAX_NAME or len(getattr(request, "cache_salt", None) or "") > MAX_NAME:
        return None  # the daemon refuses such a name (``records.MAX_NAME``)
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        name = getattr(lora, "lora_name", None)
        if not name:
            return None
        parts.append(f"lora={name}@{getattr(lora, 'lora_path', '') or ''}")
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not identifier or position is None:
            return None
        parts.append(f"mm={identifier}@{position.offset}+{position.length}")
    return ";".join(parts)


__all__ = ["request_key_extra"]
