"""Shared pytest configuration: GPU tests skip cleanly on machines without CUDA."""

from __future__ import annotations

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
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of kvcache._native")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
