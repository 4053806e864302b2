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

# kvcache into the venv without its deps; install only what is missing. The native module is
# reused from the source tree's build. Checks run from / so the current directory cannot satisfy
# `import kvcache`.
site="$(cd / && "$py" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')"
if [ "$(cat "$site/kvcache-src.pth" 2>/dev/null)" != "$repo" ]; then
  log "linking kvcache from $repo"
  echo "$repo" > "$site/kvcache-src.pth"
fi
missing=()
for mod in msgspec:msgspec zmq:pyzmq prometheus_client:prometheus-client redis:redis \
           opentelemetry.sdk:opentelemetry-sdk; do
  (cd / && "$py" -c "import ${mod%%:*}") >/dev/null 2>&1 || missing+=("${mod##*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing missing: ${missing[*]}"
  "$py" -m pip install --quiet -c "$repo/scripts/sglang/constraints.txt" "${missing[@]}" >&2
fi
(cd / && PYTHONPATH="$repo/tests/integrations/sglang/cishim" "$py" -c \
  "import sglang.srt.mem_cache.hicache_storage, kvcache") >&2
echo "$py"
