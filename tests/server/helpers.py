"""Helpers for the daemon tests: engine processes, free ports, metric scrapes."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import zmq

from kvcache.client import to_shared
from kvcache.layouts import KVFormat
from kvcache.testing import make_kv_caches

ENGINE_PROC = str(Path(__file__).with_name("engine_proc.py"))
# Small chunks keep every test fast (blocks of 4 tokens: 4 blocks per chunk). L1 holds several
# 64 MiB extents so that two layouts (two slot geometries) never compete for a single one.
BASE_ARGS = ["--chunk-size", "16", "--l1-size-gb", "0.2", "--metrics-sample-rate", "1.0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(mode: str, endpoint: str, instance: int, model: str, fmt: str, seed: int,
           **extra: object) -> subprocess.Popen[str]:  # fmt: skip
    """Start ``engine_proc.py`` (a stand-in serving engine) as its own process."""
    cmd = [sys.executable, ENGINE_PROC, mode, endpoint, str(instance), model, fmt, str(seed)]
    if extra:
        cmd.append(json.dumps(extra))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, object]:
    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and lines, f"engine process failed ({proc.returncode}):\n{err}"
    return lines[-1]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def small_kv_cache() -> list[Any]:
    """A 2-layer, 16-block cache of 4-token blocks in shared memory: what the in-process
    daemon tests register (``TOKENS``/``BLOCKS`` of 64 tokens in 16 blocks fit it)."""
    return to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                    block_size=4, head_size=8, dtype=torch.float16))  # fmt: skip


@contextlib.contextmanager
def raw_dealer(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    """A bare DEALER on ``endpoint``, for pipelining encoded requests past the client."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()
