"""Shared pytest configuration: GPU tests skip cleanly on machines without CUDA.

``KVCACHE_REQUIRE_CUDA=1`` (set by ``scripts/gpu_check.sh``) turns that skip into a failure, so
a GPU run can never pass by skipping what it exists to run.
"""

from __future__ import annotations

import os

import pytest
import torch


def cuda_usable() -> bool:
    try:
        from kvcache import _native
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and _native.cuda_compiled())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_usable():
        return
    if os.environ.get("KVCACHE_REQUIRE_CUDA") == "1":
        raise pytest.UsageError(
            "KVCACHE_REQUIRE_CUDA=1 but CUDA is not usable (no GPU, or kvcache._native built "
            "without CUDA: rebuild with KVCACHE_BUILD_CUDA=1)"
        )
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of kvcache._native")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
