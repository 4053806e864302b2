#!/usr/bin/env bash
# Sets up everything the tests need on a fresh Debian machine, then runs lint, types and tests.
# Real services: redis-server (Redis L2 tests) and promtool (metrics format check) come from
# Debian packages; the tests start and stop their own servers.
set -euo pipefail
cd "$(dirname "$0")/.."
# The serving engines' own venvs (vLLM, SGLang) take minutes of downloads on a fresh machine: build
# them in the background while setup, lint, types and the rest of the suite run. The tests that need
# them run last (tests/conftest.py) and call the same scripts, which wait on the build's lock.
if [ "${KVCACHE_SKIP_VLLM_E2E:-0}" != 1 ]; then
  bash scripts/vllm_env.sh --build-only >>.engine-venvs.log 2>&1 &
fi
if [ "${KVCACHE_SKIP_SGLANG:-0}" != 1 ]; then
  bash scripts/sglang_env.sh --build-only >>.engine-venvs.log 2>&1 &
fi
if ! command -v redis-server >/dev/null || ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends redis-server prometheus >/dev/null
  else
    echo "note: redis-server/promtool missing and not root: their tests will skip" >&2
  fi
fi
bash scripts/setup.sh test
.venv/bin/ruff check kvcache benchmarks tests setup.py
.venv/bin/ruff format --check kvcache benchmarks tests setup.py
.venv/bin/mypy
# Two workers (the machines CI runs on have two cores), whole test files to a worker (a module's
# daemons and engines start once): much of the suite waits on daemons, restarts and deadlines,
# not on the CPU. KVCACHE_TEST_WORKERS=0 runs it in one process.
.venv/bin/python -m pytest -q -n "${KVCACHE_TEST_WORKERS:-2}" --dist loadfile "$@"
