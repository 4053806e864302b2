#!/usr/bin/env bash
# Creates .venv with the local CPU torch wheel and kvcache (editable, native module built).
# Idempotent: re-running only rebuilds what changed. Set KVCACHE_BUILD_CUDA=0|1|auto.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned: the CPU wheel on these machines; a bare `torch` pulls a CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
.venv/bin/python -c "import kvcache, kvcache._native as n; print('kvcache', kvcache.__version__, '| CUDA kernels built:', n.cuda_compiled())"
