"""The SGLang tiers' shared fixture (``venv.sglang_python``): one venv lookup per session."""

from tests.integrations.sglang.venv import sglang_python

__all__ = ["sglang_python"]
