"""The key scope of a tier: which vLLM deployments may read each other's chunks.

A primary row's bytes mean the same thing only to deployments that agree on the model, its
dtype, the KV cache groups, tokens per hash and blocks per chunk, and (unless vLLM certifies the
layout parallelism-agnostic) the parallel sizes. vLLM's file-system tier names its directory
by exactly those fields (``FileMapper``); the tier reuses that rule, so two instances that would
share an fs directory share kvcache chunks, and no others. The daemon adds the row size and
dtype (the registered geometry) and the tenant's ``cache_salt`` on its side.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SCOPE_PREFIX = "vllm-tier:"


def scope_fields(offloading_spec: Any) -> dict[str, Any]:
    """vLLM's own description of what makes a primary row's bytes comparable."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
    )  # fmt: skip
    fields: dict[str, Any] = mapper.get_run_config()
    return fields


def scoped_model_name(fields: dict[str, Any], model_name: str | None = None) -> str:
    """The daemon-side model name: the model (or ``model_name``), then a digest of ``fields``."""
    if model_name:
        fields = {**fields, "model_name": model_name}
    digest = hashlib.blake2b(
        json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=8
    ).hexdigest()
    return f"{SCOPE_PREFIX}{fields.get('model_name', 'model')}#{digest}"


__all__ = ["SCOPE_PREFIX", "scope_fields", "scoped_model_name"]
