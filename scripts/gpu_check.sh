#!/usr/bin/env bash
# Everything CUDA in one go, for the day a machine with an NVIDIA GPU is at hand:
#   1. builds kvcache._native with the CUDA kernels (KVCACHE_BUILD_CUDA=1, in place);
#   2. runs every CUDA test (pytest -m cuda: kernels vs the CPU reference for every layout,
#      CUDA IPC across processes, the daemon end to end over CUDA IPC)
#      with KVCACHE_REQUIRE_CUDA=1, so nothing can pass by skipping;
#   3. runs the GPU transfer benchmark (kernel vs cudaMemcpy ceilings, bf16 and fp8, both
#      directions, chunks in pinned host and in device memory, async submit cost);
#   4. runs the kernel tests again under compute-sanitizer memcheck (caching allocator off,
#      so a copy past a tensor's end leaves its allocation and is caught);
# and writes one report directory: summary.md, the logs, JUnit XML and the benchmark JSON.
# Each step has its own time limit (STEP_TIMEOUT_S, default 300 s; pytest also limits each
# test when pytest-timeout is installed), so one hang cannot eat a short GPU lease.
#
#   bash scripts/gpu_check.sh [REPORT_DIR]        (default: $OUT if set, else gpu-report/)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# On the workplace's lent GPU (docs/gpu-runs/2026-11-26-h200/README.md): carry cp312 wheels of
# msgspec, pyzmq and redis, install them with pip --no-index --target /tmp/site, then
#   PYTHON=python3 PYTHONPATH=/tmp/site:$PWD bash scripts/gpu_check.sh /tmp/gpu-report
# PYTHON must have a CUDA build of torch, pybind11, pytest and the project's dependencies
# (default: .venv/bin/python if present, else python3). Exit status: non-zero when the build,
# any CUDA test or the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."
report="${1:-${OUT:-gpu-report}}"
mkdir -p "$report"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONUNBUFFERED=1
status=0
limit="${STEP_TIMEOUT_S:-300}"
step() {  # step NAME COMMAND...: run under the step limit, log to $report/NAME.log, remember failures
  local name="$1"; shift
  echo "== $name: $*"
  local started=$SECONDS rc=0
  timeout -k 10 "$limit" "$@" >"$report/$name.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    echo "   ok ($((SECONDS - started)) s)"; echo "| $name | ok, $((SECONDS - started)) s |" >>"$report/.steps"
  else
    status=1; echo "   FAILED ($rc, $((SECONDS - started)) s), see $report/$name.log"; tail -20 "$report/$name.log"
    echo "| $name | FAILED ($rc), $((SECONDS - started)) s |" >>"$report/.steps"
  fi
}
: >"$report/.steps"
{ nvidia-smi; nvcc --version; } >"$report/nvidia-smi.txt" 2>&1 || echo "nvidia-smi or nvcc not found" >>"$report/nvidia-smi.txt"
per_test=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout 120); fi
step torch "$py" -c "import torch; assert torch.cuda.is_available(), 'torch has no usable CUDA'; \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
if [ $status -ne 0 ]; then echo "no usable CUDA in $py: nothing else can run" >&2; fi
[ $status -eq 0 ] && step build env KVCACHE_BUILD_CUDA=1 "$py" setup.py build_ext --inplace
[ $status -eq 0 ] && step native "$py" -c "import kvcache._native as n; assert n.cuda_compiled(), 'built without CUDA'"
[ $status -eq 0 ] && step cuda-tests env KVCACHE_REQUIRE_CUDA=1 "$py" -m pytest -v -rs -m cuda -p no:cacheprovider \
  "${per_test[@]}" --junitxml "$report/cuda-tests.xml" tests
[ -f "$report/cuda-tests.log" ] && step transfer-bench "$py" -m kvcache.bench transfer --device cuda \
  --dtypes bf16,fp8 --out "$report/transfer.json"
if [ -f "$report/cuda-tests.log" ] && command -v compute-sanitizer >/dev/null; then
  step memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 KVCACHE_REQUIRE_CUDA=1 compute-sanitizer --tool memcheck \
    --error-exitcode 9 --target-processes all "$py" -m pytest -q -p no:cacheprovider "${per_test[@]}" \
    tests/transfer/test_cuda.py "tests/test_context.py::test_cuda_odd_sizes" \
    "tests/test_context.py::test_cuda_bad_ids_and_pageable_chunks"
fi
# Issue 40: a real hybrid model (sliding window or Mamba beside full attention), whose KV cache
# groups vLLM's hybrid manager keeps apart on a GPU only: greedy tokens with and without
# kvcache must match, and after vLLM's prefix cache is reset the prefix must come from kvcache.
# Needs vLLM's CUDA build (VLLM_PYTHON) and a local model (no download on the lent machine):
# KVCACHE_GPU_HYBRID_MODEL=/models/gemma-3-1b-it (sliding window) or a Granite 4.0-H /
# Nemotron-H checkpoint (Mamba). Skipped without them.
if [ -n "${KVCACHE_GPU_HYBRID_MODEL:-}" ] && [ -n "${VLLM_PYTHON:-}" ]; then
  step hybrid-model env PYTHONPATH="$PWD" "$VLLM_PYTHON" tests/integrations/vllm/vllm_hybrid_check.py \
    --model "$KVCACHE_GPU_HYBRID_MODEL" --out "$report/hybrid-model.json"
fi
{
  echo "# kvcache GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "- $(nvcc --version 2>/dev/null | tail -1)"
  echo "- python: $py ($("$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null))"
  echo
  echo "| step | result |"
  echo "|---|---|"
  cat "$report/.steps"
  echo
  echo "## CUDA tests"
  echo
  grep -E "passed|failed|error" "$report/cuda-tests.log" | tail -1
  grep -E "^(FAILED|ERROR)" "$report/cuda-tests.log" | head -40
  echo
  echo "## Transfer benchmark"
  echo
  echo '```'
  cat "$report/transfer-bench.log" 2>/dev/null
  echo '```'
  echo
  echo "## compute-sanitizer memcheck"
  echo
  echo '```'
  tail -5 "$report/memcheck.log" 2>/dev/null
  echo '```'
} >"$report/summary.md"
rm -f "$report/.steps"
echo "report: $report/summary.md"
exit $status
