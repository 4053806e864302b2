"""What one asynchronous call is, and what the pipeline asks of the session that owns it.

The contract between ``pipeline.Pipeline`` (timing: when a call is sent, which reply is its,
when it waited long enough) and ``session.Session`` (the rules: stamping, the breaker,
re-registration), apart from both so that each reads against this alone.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from kvcache.errors import DaemonUnavailableError
from kvcache.protocol import messages as m
from kvcache.protocol.breaker import CircuitBreaker
from kvcache.protocol.channel import Channel


@dataclass(eq=False)
class Call:
    """One asynchronous call: its body as the caller built it (stamped afresh at each send),
    and while in flight the envelope id, deadline and registration generation it went with."""

    body: m.RequestBody
    future: Future[m.ReplyBody]
    internal: bool = False  # a heartbeat or probe: outside the window, its reply for us only
    awaited: bool = True  # False for a notice: ``close`` does not wait for its reply
    timeout_s: float = 0.0
    request_id: int = 0
    sent_at: float = 0.0
    deadline: float = 0.0
    disconnects: int = 0
    daemon_pid: int | None = None  # the daemon process it went to, where known
    generation: int = 0
    tried: set[str] = field(default_factory=set)  # the retries already made (Owner.resend)


class Owner(Protocol):
    """What the pipeline asks of its session."""

    instance_id: int
    timeout_s: float
    breaker: CircuitBreaker

    def channel(self) -> Channel: ...

    def refusal(self) -> DaemonUnavailableError | None:
        """The error to fail a call with, unsent (the breaker is open), or None."""

    def stamp(self, body: m.RequestBody) -> tuple[m.RequestBody, int]:
        """``body`` as sent now (token, deadline) and the registration generation it carries."""

    def resend(self, call: Call, reply: m.ReplyBody) -> bool:
        """True if ``call`` must be sent again after ``reply`` (a re-registration, done here,
        blocking, on a channel of the owner's own)."""

    def silent(self, call: Call) -> None:
        """``call`` got no reply and the daemon sent nothing since it was sent."""

    def heartbeat(self) -> tuple[float, m.RequestBody | None, float]:
        """(interval, the ping to send when nothing was sent for that long or None, its wait)."""

    def beat_answered(self, pong: m.ReplyBody, generation: int) -> None:
        """The heartbeat's reply (re-registers, blocking, if the daemon forgot this instance)."""


__all__ = ["Call", "Owner"]
