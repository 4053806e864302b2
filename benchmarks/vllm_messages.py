"""What ``python -m benchmarks.vllm`` and its vLLM-side driver say to each other.

Separate from both ends because they run in different venvs (the project's and vLLM's): this
module imports neither vLLM nor torch, so each side imports it as the one definition of the
pipe's contents. One msgspec JSON line per message: commands on the driver's stdin, replies
on a pipe of their own (vLLM logs to stdout).
"""

from __future__ import annotations

from typing import Any

import msgspec


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The random LLaMA the driver builds (no download): ``intermediate`` defaults to 2 x hidden."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 0
    vocab: int = 1000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return self.intermediate or 2 * self.hidden

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4  # float32 K and V

    def label(self) -> str:
        return (
            f"LLaMA {self.layers} layers, hidden {self.hidden}, {self.heads} heads ({self.kv_heads} KV, "
            f"dim {self.head_dim}), FFN {self.ffn}, vocab {self.vocab}, fp32"
        )


OUR_CONNECTOR = "kvcache.integrations.vllm:KVCacheConnector"
"""``EngineSpec.connector_class`` of every mode but ``noop``."""


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One warm engine: ``connector`` is ``kv_connector_extra_config``, None for vLLM alone."""

    model_dir: str
    model: ModelSpec
    connector: dict[str, Any] | None
    connector_class: str = OUR_CONNECTOR
    """``module:Class`` of the connector vLLM loads (``vllm_noop`` for the plumbing's floor)."""
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_mb: int = 256
    name: str = ""
    """The mode's name, for file names."""
    profile_dir: str | None = None
    """Write a cProfile of every command here (``<name>-<n>.prof``); it slows every run."""


class Decode(msgspec.Struct, frozen=True, tag="decode"):
    """``requests`` prompts of ``prompt_tokens + 32 * i`` tokens (staggered, so their chunks
    fill in different steps), each generating ``max_tokens`` with ``ignore_eos``, in one batch."""

    seed: int
    requests: int
    prompt_tokens: int
    max_tokens: int


class Ttft(msgspec.Struct, frozen=True, tag="ttft"):
    """Request A (``prefix`` + tail A, one token) stores the prefix; vLLM's prefix cache is
    reset; request B (``prefix`` + tail B) is timed to its first token, arriving while
    ``busy`` other requests decode (64-token prompts, up to ``busy_tokens`` each; aborted
    once B has its token)."""

    seed: int
    prefix_tokens: int
    tail_tokens: int
    busy: int = 0
    busy_tokens: int = 1024


class ZeroKV(msgspec.Struct, frozen=True, tag="zero_kv"):
    """Write zeros over vLLM's whole KV cache, as its own ``torch.zeros`` does when vLLM
    allocates the cache: the connector's memfd allocation is zero by definition and its pages
    are faulted in one by one on first write, which a fresh engine would otherwise pay inside
    the timed runs (a server pays it once, during its first pass over the cache)."""


class SharedPrefix(msgspec.Struct, frozen=True, tag="shared_prefix"):
    """``requests`` prompts that share the ``seed``'s prefix of ``prefix_tokens``, each with a
    tail of its own (``tail_tokens``), all added before the engine's next step and each timed
    to its first token (one token each); then vLLM's prefix cache is reset. ``store``: one
    prompt of the prefix with a tail no timed request has, to store the prefix (untimed).
    The tokens depend on ``seed`` only, so every mode sees the same prompts."""

    seed: int
    prefix_tokens: int
    tail_tokens: int
    requests: int = 1
    store: bool = False


class Quit(msgspec.Struct, frozen=True, tag="quit"):
    pass


Command = Decode | Ttft | SharedPrefix | ZeroKV | Quit

Calls = dict[str, tuple[int, float]]
"""Connector method -> (calls, seconds) during one command (empty for vLLM alone)."""


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    startup_s: float
    torch_threads: int
    async_scheduling: bool
    kvcache_path: str
    """Where the engine imported kvcache from (the code measured)."""


class DecodeResult(msgspec.Struct, frozen=True, tag="decode_result"):
    generated: int
    """Tokens generated, all requests."""
    seconds: float
    """From adding the requests to the last token."""
    decode_tokens: int
    """Tokens after each request's first one."""
    decode_seconds: float
    """From the step that gave the last request its first token to the last token."""
    step_s: list[float]
    """Every ``LLMEngine.step`` of the run, in order."""
    settle_s: float
    """After the last token, until vLLM could reset its prefix cache (stores settled)."""
    digest: str
    """Hash of every generated token id: modes must agree."""
    calls: Calls
    stats: dict[str, float]
    """The connector's counters (``get_kv_connector_stats``), settling included."""
    cpu_s: float = 0.0
    """CPU time of the whole engine process (every thread) during the steps."""
    main_cpu_s: float = 0.0
    """CPU time of the thread that steps the engine (vLLM's and the connector's work)."""
    main_preempted: int = 0
    """Involuntary context switches of that thread: how often it was taken off its core."""
    page_faults: int = 0
    """Minor page faults of the engine process: first touches of memory, e.g. KV cache pages."""


class TtftResult(msgspec.Struct, frozen=True, tag="ttft_result"):
    ttft_s: float
    """Request B, from ``add_request`` to its first token."""
    cached_tokens: int
    """B's prompt tokens vLLM did not compute (loaded from kvcache, or its own prefix cache)."""
    first_token: int
    store_s: float
    """Request A, and stepping until vLLM freed its blocks (its stores settled)."""
    calls: Calls
    """Request B's."""
    stats: dict[str, float]
    """The connector's counters over A and B."""
    step_s: list[float] = []
    """The steps from adding B to its first token (with busy requests: what each of their
    tokens waited)."""


class SharedResult(msgspec.Struct, frozen=True, tag="shared_result"):
    ttft_s: list[float]
    """Per request, from adding them all to its first token."""
    cached_tokens: list[int]
    """Per request, prompt tokens vLLM did not compute (loaded, or found in its prefix cache)."""
    prompt_tokens: list[int]
    first_tokens: list[int]
    seconds: float
    """The whole command, until vLLM could reset its prefix cache (stores settled)."""
    calls: Calls
    """The connector's methods until the last first token."""
    stats: dict[str, float]
    """The connector's counters, settling included."""
    step_s: list[float]
    """The steps until the last first token."""


class Zeroed(msgspec.Struct, frozen=True, tag="zeroed"):
    bytes: int
    seconds: float
    page_faults: int


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    error: str


Reply = Ready | DecodeResult | TtftResult | SharedResult | Zeroed | Failed

__all__ = ["Calls", "Command", "Decode", "DecodeResult", "EngineSpec", "Failed", "ModelSpec", "Quit", "Ready",
           "Reply", "SharedPrefix", "SharedResult", "Ttft", "TtftResult", "ZeroKV", "Zeroed"]  # fmt: skip
