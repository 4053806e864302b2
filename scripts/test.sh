#!/usr/bin/env bash
# Sets up everything the tests need on a fresh Debian machine, then runs lint, types and tests.
# Real services: redis-server (Redis L2 tests) and promtool (metrics format check) come from
# Debian packages; the tests start and stop their own servers.
set -euo pipefail
cd "$(dirname "$0")/.."
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
.venv/bin/ruff check kvcache tests setup.py
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
