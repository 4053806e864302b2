"""The disaggregation benchmark's client: the workload, sent as streaming OpenAI completions
to one endpoint (the proxy or a single vLLM), with the arrival time of every token.

Separate from the benchmark so the same workload and the same clock meet both targets, and
testable against any small HTTP server. Standard library only (a thread per stream: a few
streams at a time, and the benchmark's process need not have an HTTP library).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec


class Workload(msgspec.Struct, frozen=True):
    """``decoders`` short prompts that generate ``decode_tokens`` each, all decoding before the
    first of ``long_prompts`` (long prompts, ``long_tokens`` generated each) arrives; the long
    ones then arrive ``gap_s`` apart. Token ids in ``[3, vocab)``: the bench model's words."""

    decoders: list[list[int]]
    decode_tokens: int
    long_prompts: list[list[int]]
    long_tokens: int
    gap_s: float

    @classmethod
    def make(
        cls,
        seed: int,
        *,
        decoders: int,
        decode_prompt: int,
        decode_tokens: int,
        long_prompts: int,
        long_prompt: int,
        long_tokens: int,
        gap_s: float,
        vocab: int,
    ) -> Workload:
        rng = random.Random(seed)

        def ids(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        # Odd lengths: the last chunk and the last block of each prompt are partial.
        return cls(
            [ids(decode_prompt + 7 * i) for i in range(decoders)],
            decode_tokens,
            [ids(long_prompt + 13 * i + 5) for i in range(long_prompts)],
            long_tokens,
            gap_s,
        )


@dataclass
class Stream:
    """One request: when it was sent, when each token event arrived, what it said."""

    kind: str
    sent: float = 0.0
    times: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    prefill_s: float | None = None
    """Through the proxy: its prefill call's duration (its ``Server-Timing`` header)."""

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def stream(
    base: str,
    prompt: list[int],
    max_tokens: int,
    out: Stream,
    timeout_s: float,
    started: threading.Event | None = None,
) -> None:
    """Send one streaming completion and record it in ``out``; ``started`` is set at the
    first token (or on failure, so that nobody waits for it)."""
    u = urlsplit(base)
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    try:
        out.sent = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:500]!r}"
            return
        timing = resp.getheader("Server-Timing", "")
        if timing.startswith("prefill;dur="):
            out.prefill_s = float(timing.removeprefix("prefill;dur=")) / 1e3
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = str(event["error"])
                return
            out.times.append(time.perf_counter())
            out.text += "".join(c.get("text", "") for c in event.get("choices", []))
            if started is not None and len(out.times) == 1:
                started.set()
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        if started is not None:
            started.set()


def run(base: str, w: Workload, timeout_s: float) -> list[Stream]:
    """The workload against ``base``: the decoders first, each decoding before the long
    prompts start arriving; returns every request's record once all are done."""
    streams: list[Stream] = []
    threads: list[threading.Thread] = []

    def launch(kind: str, prompt: list[int], max_tokens: int, started: threading.Event | None = None) -> None:
        s = Stream(kind)
        streams.append(s)
        t = threading.Thread(
            target=stream, args=(base, prompt, max_tokens, s, timeout_s, started), daemon=True
        )
        t.start()
        threads.append(t)

    flags = [threading.Event() for _ in w.decoders]
    for prompt, flag in zip(w.decoders, flags, strict=True):
        launch("decode", prompt, w.decode_tokens, flag)
    for flag in flags:
        flag.wait(timeout_s)
    for i, prompt in enumerate(w.long_prompts):
        if i:
            time.sleep(w.gap_s)  # the workload's arrival pattern
        launch("long", prompt, w.long_tokens)
    for t in threads:
        t.join(timeout_s)
    return streams
