"""The world a scheduler-harness scenario runs in (vLLM venv only): daemons, a reader engine.

``RestartableDaemon`` can be killed, stopped and started again in place; ``Reader`` is a third engine on
the same model that asks the daemon for a request's tokens and compares every byte it is
served with the oracle; ``Harness`` holds a scenario's engines and runs the common checks
(``check``). Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvcache.client import KVCacheClient
from kvcache.errors import DeadlineExceededError
from kvcache.integrations.vllm.request_keys import request_key_extra
from kvcache.protocol import messages as m
from kvcache.server.launch import DaemonProcess, Spawn
from kvcache.transport.memfd import empty_shared
from tests.integrations.vllm.sched_engine import (
    BLOCK,
    KV_HEADS,
    LAYERS,
    WIDTH,
    Engine,
    Oracle,
    StepLog,
    vllm_config,
)

CHUNK = 64  # two vLLM blocks per kvcache chunk
READER_BLOCKS = 48
Facts = dict[str, Any]


class ScenarioSkipped(Exception):
    """The scenario needs something this machine lacks (the test reports a skip)."""


def stored_tokens(seq_len: int) -> int:
    """Whole chunks with KV when a request ends with ``seq_len`` tokens (the last sampled
    token is never fed, so it has none)."""
    return (seq_len - 1) // CHUNK * CHUNK


class RestartableDaemon:
    """A daemon in a fixed runtime directory (so at a fixed ipc:// endpoint), so that it can
    be killed and started again in place."""

    def __init__(self, spawn: Spawn | None, extra: Sequence[str] = ()) -> None:
        self.args = ["--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--disable-metrics", *extra]
        self.spawn = spawn
        self.runtime_dir = tempfile.mkdtemp(prefix="kvcache-sched-")
        self.proc = self.start()
        self.endpoint = self.proc.endpoint

    def start(self) -> DaemonProcess:
        """A fresh daemon process at this daemon's endpoint."""
        return DaemonProcess(self.args, runtime_dir=self.runtime_dir, prometheus_port=0, spawn=self.spawn)

    def kill(self) -> None:
        self.proc.stop(signal.SIGKILL)

    def restart(self, graceful: bool = False) -> None:
        """SIGKILL (or SIGTERM: L2 writes finish), then a fresh daemon (empty L1) in place."""
        if graceful and self.proc.proc.poll() is None:
            self.proc.stop()
        else:
            self.kill()
        self.proc = self.start()

    def close(self) -> None:
        if self.proc.proc.poll() is None:
            self.proc.stop()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


class Reader:
    """A third engine on the same model: what would another engine be served?"""

    def __init__(self, endpoint: str, model: str) -> None:
        self.client = KVCacheClient(endpoint, 7_000_001, model, timeout_s=10)
        self.kv = [
            empty_shared([READER_BLOCKS, KV_HEADS, BLOCK, WIDTH], torch.float32) for _ in range(LAYERS)
        ]
        self.client.register_kv_caches(self.kv, engine="vllm", block_size=BLOCK, fmt="NL_X_NB_PAGE")

    def served(self, identity: str, tokens: Sequence[int], key_extra: str, salt: str = "") -> int:
        """Look ``tokens`` up, retrieve the hit and compare it with the oracle; the hit."""
        hit = self.client.lookup(tokens, cache_salt=salt, key_extra=key_extra)
        if not hit:
            return 0
        blocks = list(range(hit // BLOCK))
        for cache in self.kv:
            cache.fill_(-1.0)
        got = self.client.retrieve(tokens[:hit], blocks, cache_salt=salt, key_extra=key_extra)
        assert got == hit, f"lookup said {hit} tokens, retrieve copied {got}"
        for layer, cache in enumerate(self.kv):
            want = Oracle.kv(identity, tokens[:hit], layer).reshape(hit // BLOCK, BLOCK, KV_HEADS, WIDTH)
            have = cache[blocks].permute(0, 2, 1, 3)
            bad = (have != want).flatten(2).any(2).flatten().nonzero()
            assert not len(bad), (
                f"the daemon serves wrong KV for {identity!r} at positions {bad.flatten()[:8].tolist()} "
                f"(layer {layer}, hit {hit})"
            )
        return hit

    def store_oracle(self, identity: str, tokens: Sequence[int], key_extra: str = "") -> None:
        """Store the oracle's (right) bytes for ``tokens`` (whole chunks)."""
        n = len(tokens) // CHUNK * CHUNK
        for layer, cache in enumerate(self.kv):
            want = Oracle.kv(identity, tokens[:n], layer).reshape(n // BLOCK, BLOCK, KV_HEADS, WIDTH)
            cache[: n // BLOCK] = want.permute(0, 2, 1, 3)
        self.client.store(tokens[:n], list(range(n // BLOCK)), key_extra=key_extra)

    def close(self) -> None:
        self.client.close()


class Harness:
    """One scenario's world: the model directory, daemons, engines and the checks."""

    def __init__(self, name: str, workdir: Path, spawn: Spawn | None, *, async_loads: bool = True) -> None:
        self.name, self.workdir, self.spawn = name, workdir, spawn
        self.daemon = RestartableDaemon(spawn)
        self.async_loads = async_loads
        """The connector's ``async_loads`` for this run's engines (async scheduling forces it).
        Every load of an asynchronous run is asynchronous (``sync_lone_loads: false``) unless a
        scenario asks for the default (``engine(sync_lone_loads=True)``), so the scenarios of
        loads that outlive their step still have them when a request loads alone."""
        self.model = f"harness-{name}"
        self.engines: list[Engine] = []
        self.facts: Facts = {}
        self.cleanups: list[Callable[[], None]] = []
        self._reader: Reader | None = None

    def replace_daemon(self, extra: Sequence[str]) -> RestartableDaemon:
        """The harness's daemon closed and replaced by one started with ``extra`` flags."""
        self.daemon.close()
        self.daemon = RestartableDaemon(self.spawn, extra)
        return self.daemon

    def engine(
        self,
        *,
        async_scheduling: bool = False,
        num_blocks: int = 128,
        timeout_s: float = 10.0,
        max_batched: int = 96,
        async_stores: bool = True,
        sync_lone_loads: bool = False,
    ) -> Engine:
        extra = {
            "endpoint": self.daemon.endpoint,
            "model_name": self.model,
            "timeout_s": timeout_s,
            "async_stores": async_stores,
            "async_loads": self.async_loads,
            "sync_lone_loads": sync_lone_loads,
        }
        config = vllm_config(
            str(self.workdir / "model"), extra, async_scheduling=async_scheduling, max_batched=max_batched
        )
        eng = Engine(config, num_blocks)
        self.engines.append(eng)
        return eng

    @property
    def reader(self) -> Reader:
        if self._reader is None:
            self._reader = Reader(self.daemon.endpoint, self.model)
        return self._reader

    def check(self, eng: Engine, *, all_stored: bool = True) -> None:
        """The three checks of the module docstring, for every request of ``eng``."""
        eng.check_wrong_reads()
        for req_id, request in eng.requests.items():
            identity = eng.identity[req_id]
            prompt = list(request.prompt_token_ids or [])
            want = Oracle.generate(identity, prompt, request.max_tokens)
            out = eng.outputs(req_id)
            if req_id in eng.aborted:  # what it produced before the abort
                assert len(out) < len(want) and out == want[: len(out)], f"{req_id}: outputs differ"
            else:
                assert out == want, f"{req_id}: outputs differ from the oracle's"
            key_extra = request_key_extra(request)
            if key_extra is None:
                continue
            tokens = prompt + out
            hit = self.reader.served(identity, tokens, key_extra)
            if all_stored:  # an aborted request may have KV for its last sampled token too
                assert stored_tokens(len(tokens)) <= hit <= len(tokens) // CHUNK * CHUNK, (
                    f"{req_id}: the daemon holds {hit} of its {stored_tokens(len(tokens))} tokens with KV"
                )
                assert req_id in eng.aborted or hit == stored_tokens(len(tokens))

    def check_all_done(self) -> None:
        """The scenario's end: every request of every engine finished (its tokens, a stop, or
        an abort) and the scheduler holds none; each ``Engine.run`` bounds the wall-clock time
        it takes to get there, so a request left behind fails its run instead of hanging it."""
        for eng in self.engines:
            unfinished = sorted(r for r, q in eng.requests.items() if not q.is_finished())
            assert not unfinished, f"{self.name}: requests never finished: {unfinished}"
            held = list(eng.scheduler.requests)
            assert not held, f"{self.name}: the scheduler still holds {held}"

    def close(self) -> None:
        for eng in self.engines:
            eng.shutdown()
        if self._reader is not None:
            self._reader.close()


def prompts(seed: int, prefix_len: int, tails: Sequence[int]) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in tails]


def warm(h: Harness, *requests: tuple[str, list[int]]) -> None:
    """An engine that computes and stores ``requests`` (two output tokens each)."""
    eng = h.engine()
    for req_id, prompt in requests:
        eng.add(req_id, prompt, 2)
    eng.run()
    h.check(eng)


def hold_loads(client: KVCacheClient, req_ids: set[str], within_s: float = 60.0) -> threading.Event:
    """Hold ``client``'s asynchronous loads for ``req_ids`` back, before they reach the daemon,
    until the returned event is set (at most ``within_s``: a scenario that never opens it
    fails instead of hanging). Each is held on a thread of its own: the client's background
    thread, which sends one call at a time, stays free for the other requests' transfers."""
    gate = threading.Event()
    retrieve_async = client.retrieve_reply_async

    def held(*args: Any, **kw: Any) -> Future[m.RetrieveResult]:
        if kw.get("request_id") not in req_ids:
            return retrieve_async(*args, **kw)
        out: Future[m.RetrieveResult] = Future()

        def send_later() -> None:
            gate.wait(within_s)
            inner = retrieve_async(*args, **kw)
            inner.add_done_callback(
                lambda f: out.set_exception(exc) if (exc := f.exception()) else out.set_result(f.result())
            )

        threading.Thread(target=send_later, name="held-load", daemon=True).start()
        return out

    client.retrieve_reply_async = held  # type: ignore[method-assign]
    return gate


def fail_sync_loads(client: KVCacheClient, req_ids: set[str]) -> list[str]:
    """``client``'s first synchronous load of each of ``req_ids`` times out before it reaches
    the daemon, as a daemon that does not answer within ``timeout_s`` would: nothing is
    copied. Returns the list those failures are appended to."""
    failed: list[str] = []
    retrieve_reply = client.retrieve_reply

    def timing_out(*args: Any, **kw: Any) -> m.RetrieveResult:
        req_id = kw.get("request_id")
        if req_id in req_ids and req_id not in failed:
            failed.append(req_id)
            raise DeadlineExceededError("injected: the load timed out")
        return retrieve_reply(*args, **kw)

    client.retrieve_reply = timing_out  # type: ignore[method-assign]
    return failed


def first_step(eng: Engine, pick: Callable[[StepLog], bool]) -> int:
    """The first step ``pick`` selects, or -1."""
    return next((s.step for s in eng.steps if pick(s)), -1)


def wait_for_log(daemon: RestartableDaemon, text: str, within_s: float = 30.0) -> None:
    """Until the daemon has logged ``text`` (bounded): its work is done, whatever it was."""
    deadline = time.monotonic() + within_s
    while not any(text in line for line in daemon.proc.lines):
        assert time.monotonic() < deadline, f"the daemon never logged {text!r}"
        time.sleep(0.05)


def count_sends(client: KVCacheClient, sends: dict[str, int], role: str) -> None:
    def counted(body: Any, send: Any) -> Any:
        sends[role] += 1
        return send(body)

    client.session.intercept(counted)


def wait_closed(client: KVCacheClient, within_s: float = 30.0) -> None:
    """The breaker's own probe closes it; wait for that (bounded), never for a fixed time."""
    deadline = time.monotonic() + within_s
    while client.breaker.open:
        assert time.monotonic() < deadline, "the breaker never closed after the daemon came back"
        time.sleep(0.05)


def check_outputs(eng: Engine) -> None:
    eng.check_wrong_reads()
    for req_id, request in eng.requests.items():
        want = Oracle.generate(eng.identity[req_id], list(request.prompt_token_ids or []), request.max_tokens)
        assert eng.outputs(req_id) == want, f"{req_id}: outputs differ from the oracle's"


@contextmanager
def harness(name: str, workdir: Path, spawn: Spawn | None, *, async_loads: bool = True) -> Iterator[Harness]:
    """A scenario's world; its daemons start through ``spawn`` (the zygote: no torch import per
    daemon), or by exec when None."""
    h = Harness(name, workdir, spawn, async_loads=async_loads)
    try:
        yield h
    finally:
        h.close()
        h.daemon.close()
        for cleanup in h.cleanups:
            cleanup()
