"""The client's background thread: up to a window of asynchronous calls in flight on one socket.

Separate from the session (synchronous calls, registration, what a reply means for the
breaker and for re-registering) because this part is only about timing: when a call is sent,
which reply belongs to it, when it has waited long enough. The session supplies the rules
through ``Owner``.

One thread (``kvcache-client-<id>``) owns one DEALER ``Channel``. Calls queue in submission
order and are sent while fewer than ``window`` of them are in flight; each reply is matched to
its call by envelope id, so a slow call never holds up the replies of the calls sent after
it. Each call has its own deadline (``timeout_s`` from its send): past it the call alone
fails, and a late reply is dropped by id; the socket is not reset, as other calls are still in
flight on it. The breaker opens only when the daemon was silent for a call's whole wait (no
frame at all since it was sent), not when one call is slow while others are answered.

The thread also sends the heartbeat (a ping whenever nothing was sent for a while, calls in
flight or not, so a slow call does not look like a dead daemon), and while the breaker is open
a probe per ``probe_interval_s``. It starts on the first call and runs until ``close``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from kvcache.client.calls import Call, Owner
from kvcache.client.hooks import Send
from kvcache.errors import AccessDeniedError, ProtocolError
from kvcache.protocol import messages as m
from kvcache.protocol.channel import Channel

log = logging.getLogger("kvcache.client")

DEFAULT_WINDOW = 32
"""Asynchronous calls one client keeps in flight at the daemon, at most (1: one at a time)."""


_IDLE_WAIT_S = 60.0
"""The longest wait with nothing due (``_wait_s``): new calls and ``close`` wake it anyway."""


class Pipeline:
    """The queue, the window and the background thread of one session.

    Thread rules: ``submit``, ``queued`` and ``close`` may be called from any thread;
    everything else runs on the background thread, which resolves every future (and so runs
    their done-callbacks). Calls are sent in submission order; replies resolve in any order.
    """

    def __init__(self, owner: Owner, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self._owner = owner
        self._lock = threading.Lock()
        self._queue: deque[Call] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._release: Callable[[], None] | None = None  # left by a close that gave up waiting
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._in_flight: dict[int, Call] = {}  # background thread only
        self._calls = 0  # of _in_flight, the callers' calls (the window counts these)
        self._last_send = time.monotonic()
        self._beat: Call | None = None  # the heartbeat or probe in flight

    def submit(self, body: m.RequestBody, *, awaited: bool = True) -> Future[m.ReplyBody]:
        """Queue a call. ``awaited=False`` marks a notice: it is still sent before ``close``
        returns, but its reply is not waited for (a store or retrieve moves bytes, so its
        reply is; a lifecycle report sent to a daemon that died would hold ``close`` for its
        whole deadline)."""
        future: Future[m.ReplyBody] = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("KVCacheClient is closed")
            self._queue.append(Call(body, future, awaited=awaited))
            self._start()
        self._wake()
        return future

    @property
    def window(self) -> int:
        """Calls in flight at most; may be changed at any time (takes effect at the next send)."""
        return self._window

    @window.setter
    def window(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"window must be >= 1, got {value}")
        self._window = value

    def call(self, body: m.RequestBody) -> m.ReplyBody:
        """``submit`` and wait for the reply (bounded by the call's deadline)."""
        return self.submit(body).result()

    def submit_hooked(self, body: m.RequestBody, send: Send) -> Future[m.ReplyBody]:
        """``send(body)`` (hooks around ``call``) on a thread of its own: a hook that holds one
        call back holds back no other. Calls the hooks let through are sent in the order they
        reach ``call``."""
        future: Future[m.ReplyBody] = Future()

        def run() -> None:
            try:
                if (refusal := self._owner.refusal()) is not None:
                    raise refusal
                future.set_result(send(body))
            except BaseException as exc:
                future.set_exception(exc)

        name = f"kvcache-client-hook-{self._owner.instance_id}"
        threading.Thread(target=run, name=name, daemon=True).start()
        return future

    def queued(self) -> int:
        """Calls waiting to be sent (not yet in flight)."""
        return len(self._queue)

    def ensure_running(self) -> None:
        """Start the thread (for the heartbeat, or to probe a tripped breaker)."""
        with self._lock:
            if not self._closing:
                self._start()
        self._wake()

    def close(self, timeout_s: float, release: Callable[[], None]) -> bool:
        """Send what is queued, wait for the calls in flight (each until its deadline), stop,
        then ``release`` (what the thread's socket needs while open). False if the thread was
        still busy after ``timeout_s``: it runs ``release`` as it ends (if it ever does)."""
        with self._lock:
            self._closing = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout_s)
        with self._lock:
            if self._thread is not None:
                self._release = release
                return False
        self._released(release)
        return True

    def _released(self, release: Callable[[], None]) -> None:
        wake_w, self._wake_w = self._wake_w, -1
        os.close(wake_w)
        os.close(self._wake_r)
        release()

    def _start(self) -> None:
        if self._thread is None:
            name = f"kvcache-client-{self._owner.instance_id}"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        if self._wake_w < 0:  # closed (its number may belong to another file by now)
            return
        with contextlib.suppress(BlockingIOError, OSError):  # full: it is awake already
            os.write(self._wake_w, b"x")

    # -- the background thread ---------------------------------------------------------

    def _run(self) -> None:
        chan = self._owner.channel()
        seen = chan.disconnects
        try:
            while True:
                self._fill(chan)
                if self._closing and not self._queue and not self._awaited():
                    return
                try:
                    replies = chan.receive(self._wait_s(), self._wake_r)
                except ProtocolError as exc:
                    self._undecodable(exc)
                    continue
                except AccessDeniedError as exc:  # the socket was reset: every call is lost
                    self._fail_all(exc)
                    continue
                self._drain_wake()
                for envelope in replies:
                    self._answer(chan, envelope)
                if chan.disconnects != seen:
                    seen = chan.disconnects
                    self._fail_lost(chan)
                self._expire(chan)
                self._heartbeat(chan)
        except BaseException as exc:  # never leave a caller waiting on a dead thread
            log.exception("the kvcache client thread failed")
            self._fail_all(exc)
            raise
        finally:
            chan.close()
            with self._lock:
                self._thread = None
                release, self._release = self._release, None
                left = [*self._queue, *self._in_flight.values()]
                self._queue.clear()
                self._in_flight.clear()
            for call in left:  # a queued call's caller may have cancelled it
                if not call.future.done():
                    call.future.set_exception(RuntimeError("KVCacheClient is closed"))
            if release is not None:  # ``close`` gave up waiting for this thread
                self._released(release)

    def _awaited(self) -> bool:
        """Whether a call ``close`` waits for is still in flight."""
        return self._calls > 0 and any(c.awaited and not c.internal for c in self._in_flight.values())

    def _fill(self, chan: Channel) -> None:
        """Send queued calls, in order, while the window has room."""
        while self._calls < self.window:
            with self._lock:
                if not self._queue:
                    return
                call = self._queue.popleft()
            if not call.future.set_running_or_notify_cancel():
                continue
            refusal = self._owner.refusal()
            if refusal is not None:
                call.future.set_exception(refusal)
                continue
            call.timeout_s = self._owner.timeout_s
            self._send(chan, call)

    def _send(self, chan: Channel, call: Call) -> None:
        try:
            body, call.generation = self._owner.stamp(call.body)
            call.request_id = chan.send(body)  # reads the monitor first
            call.disconnects, call.daemon_pid = chan.disconnects, chan.daemon_pid
        except Exception as exc:
            call.future.set_exception(exc)
            return
        now = time.monotonic()
        call.sent_at, call.deadline = now, now + call.timeout_s
        self._last_send = now
        self._in_flight[call.request_id] = call
        self._calls += not call.internal

    def _pop(self, request_id: int) -> Call | None:
        call = self._in_flight.pop(request_id, None)
        if call is not None:
            self._calls -= not call.internal
        return call

    def _answer(self, chan: Channel, envelope: m.ReplyEnvelope) -> None:
        call = self._pop(envelope.id)
        if call is None and envelope.id == 0 and len(self._in_flight) == 1:
            # The daemon could not read the id of a request; with one in flight it is that one.
            call = self._pop(next(iter(self._in_flight)))
        if call is None:  # the reply of a call that timed out (or an unmatched id 0): dropped
            log.debug("dropped a reply for request %d, no longer in flight", envelope.id)
            return
        if call.internal:
            call.future.set_result(envelope.body)
            return
        try:
            again = self._owner.resend(call, envelope.body)
        except Exception as exc:  # re-registering failed: the call fails with its reason
            call.future.set_exception(exc)
            return
        if again:
            self._send(chan, call)
        else:
            call.future.set_result(envelope.body)

    def _expire(self, chan: Channel) -> None:
        """Fail each call whose deadline passed, alone; its late reply will be dropped."""
        now = time.monotonic()
        for request_id, call in list(self._in_flight.items()):
            if call.deadline > now:
                continue
            self._pop(request_id)
            chan.withdraw(request_id)  # not sent yet (no connection since): never will be
            closed = chan.disconnects != call.disconnects
            call.future.set_exception(chan.timeout_error(call.body, call.timeout_s, closed))
            if not call.internal and self._owner.breaker.silent_since(call.sent_at):
                self._owner.silent(call)

    def _fail_lost(self, chan: Channel) -> None:
        """A connection dropped: fail each call sent before to a daemon that exited, now."""
        exited: dict[int | None, bool] = {}
        for request_id, call in list(self._in_flight.items()):
            if call.disconnects == chan.disconnects:  # sent since the drop
                continue
            if call.daemon_pid not in exited:
                exited[call.daemon_pid] = chan.daemon_exited(call.daemon_pid)
            if exited[call.daemon_pid]:
                self._pop(request_id)
                chan.withdraw(request_id)
                call.future.set_exception(chan.lost_error(call.body, call.daemon_pid))

    def _wait_s(self) -> float:
        """Until the next deadline or heartbeat; 0 with sendable calls queued. With no beat to
        send (a client that never registered, as vLLM's scheduler half) or one in flight, the
        heartbeat time is no deadline: a zero wait past it spun this thread, holding the GIL,
        until the next call (issue 42). A new call, or ``close``, wakes the wait."""
        if self._queue and self._calls < self.window:
            return 0.0
        interval, ping, _ = self._owner.heartbeat()
        beat_due = ping is not None and (self._beat is None or self._beat.future.done())
        when = self._last_send + interval if beat_due else time.monotonic() + _IDLE_WAIT_S
        for call in self._in_flight.values():
            when = min(when, call.deadline)
        return max(0.0, when - time.monotonic())

    def _heartbeat(self, chan: Channel) -> None:
        """A ping when nothing was sent for the heartbeat interval (a probe while the breaker
        is open); one at a time."""
        if self._beat is not None and not self._beat.future.done():
            return
        interval, ping, wait_s = self._owner.heartbeat()
        if ping is None or time.monotonic() - self._last_send < interval:
            return
        call = self._beat = Call(ping, Future(), internal=True, timeout_s=wait_s)
        call.future.set_running_or_notify_cancel()
        self._send(chan, call)
        generation = call.generation
        call.future.add_done_callback(lambda f: self._beat_done(f, generation))

    def _beat_done(self, future: Future[m.ReplyBody], generation: int) -> None:
        if future.exception() is not None:  # no answer: the next beat asks again
            return
        try:
            self._owner.beat_answered(future.result(), generation)
        except Exception as exc:
            log.warning("handling the heartbeat's reply failed: %s", exc)

    def _undecodable(self, exc: ProtocolError) -> None:
        """A reply that does not decode: the call's, if only one is in flight; else logged
        (its call times out)."""
        calls = [c for c in self._in_flight.values() if not c.internal]
        if len(calls) == 1:
            self._pop(calls[0].request_id)
            calls[0].future.set_exception(exc)
        else:
            log.warning("dropped a reply the client cannot decode: %s", exc)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._in_flight):
            call = self._pop(request_id)
            if call is not None and not call.future.done():
                call.future.set_exception(exc)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass


__all__ = ["DEFAULT_WINDOW", "Pipeline"]
