"""The serving engines' benchmark harnesses, run from a checkout: ``python -m benchmarks.vllm``,
``benchmarks.vllm_shared``, ``benchmarks.sglang``, ``benchmarks.disagg``.

Outside the ``kvcache`` package because they need what only a checkout has: the engines' venv
scripts (``scripts/vllm_env.sh``, ``scripts/sglang_env.sh``) and drivers that the engines' own
venvs import from this directory. What a user runs against an installed kvcache stays in
``python -m kvcache.bench``.
"""
