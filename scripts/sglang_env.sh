#!/usr/bin/env bash
# Builds (once) the separate venv the SGLang tests run in, and prints its python path.
#
# Why a separate venv: SGLang pins its own dependency set (transformers, xgrammar, openai, ...) and,
# installed plainly, a CUDA torch with ~25 nvidia wheels. The CPU recipe instead: the local CPU
# torch wheel, `--no-deps sglang`, then the import-time dependencies under a constraint that keeps
# torch on the CPU wheel (scripts/sglang/). SGLang 0.5.23 pins torch 2.14.1; it runs here on
# 2.13.0+cpu, an unsupported pairing that the tests prove for what kvcache uses.
# The build takes minutes, so it is cached: a marker file records the SGLang version; re-running is
# a no-op once the marker exists (kvcache itself is linked from the source tree).
#
# Location: $KVCACHE_SGLANG_VENV, default <repo>/.sglang-venv. Version: $KVCACHE_SGLANG_VERSION
# (0.5.23). Last line of stdout: the venv's python. Exit 3: SGLang cannot be installed here (tests skip).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KVCACHE_SGLANG_VENV:-$repo/.sglang-venv}"
version="${KVCACHE_SGLANG_VERSION:-0.5.23}"
marker="$venv/.kvcache-sglang-$version"
py="$venv/bin/python"
log() { echo "sglang_env: $*" >&2; }
# shellcheck source=scripts/engine_venv.sh
source "$repo/scripts/engine_venv.sh"
lock_venv

if [ ! -f "$marker" ]; then
  if [ ! -x "$py" ]; then
    log "creating $venv"
    python3 -m venv "$venv"
  fi
  log "installing sglang==$version, CPU recipe (minutes)"
  if ! "$py" -m pip install --quiet "torch==2.13.0" >&2 \
     || ! "$py" -m pip install --quiet --no-deps "sglang==$version" >&2 \
     || ! "$py" -m pip install --quiet -c "$repo/scripts/sglang/constraints.txt" \
            -r "$repo/scripts/sglang/requirements-cpu.txt" >&2; then
    log "pip could not install sglang==$version with its CPU dependencies"
    exit 3
  fi
  touch "$marker"
fi

# --build-only: stop here (scripts/test.sh builds in the background before kvcache's native
# module exists; the tests' own call links and checks it).
if [ "${1:-}" = "--build-only" ]; then exit 0; fi
# kvcache linked into the venv; the native module is reused from the source tree's build.
# Checks run from / so that the current directory cannot satisfy `import kvcache`.
link_kvcache -c "$repo/scripts/sglang/constraints.txt"
(cd / && PYTHONPATH="$repo/tests/integrations/sglang/cishim" "$py" -c \
  "import sglang.srt.mem_cache.hicache_storage, kvcache") >&2
echo "$py"
