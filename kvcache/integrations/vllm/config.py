"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` dict.

Parsed in one place so that both halves of the connector (scheduler and worker, possibly in
different processes) derive the same instance id and model name from the same vLLM config:
they must agree, since the scheduler looks up what the worker registered.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvcache.protocol.messages import MAX_LOOKUP_BATCH

_MAX_INSTANCE_BASE = 1 << 30


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys (all optional).

    * ``endpoint``: the daemon's ZMQ address (default: the local daemon's Unix socket,
      ``ipc://$KVCACHE_RUNTIME_DIR/daemon.sock`` or ``ipc:///tmp/kvcache-UID/daemon.sock``).
    * ``curve_server_key`` / ``curve_secret_key``: for a remote daemon that requires CURVE
      (its public key, Z85 or a ``.key`` file; this engine's ``.key_secret`` file).
    * ``instance_id``: this engine's id at the daemon; tensor-parallel rank ``r`` uses
      ``instance_id + r``. Default: derived from vLLM's ``engine_id``.
    * ``model_name``: scopes the cache keys (default: vLLM's served model name). Engines that
      should share cached prefixes must use the same name. Under tensor parallelism each
      group of ranks holding the same bytes gets its own scope (``TPGroup``).
    * ``timeout_s``: bound on every daemon call; on a timeout the connector carries on
      without the cache (lookups count as misses, stores are dropped).
    * ``window``: asynchronous calls (stores, asynchronous loads, notices) each worker keeps
      in flight at the daemon (default 32); 1 sends each only after the previous one's reply.
    * ``load`` / ``store``: switch either direction off.
    * ``kv_format``: a ``KVFormat`` name for the registered tensors (default: opaque pages
      on CPU, detection from the tensor shapes on GPU).
    * ``async_stores``: issue stores without waiting for the daemon's copies (default True);
      vLLM keeps a finished request's blocks until its stores are done. False: every store is
      waited for at the end of its step (``wait_for_save``), as before.
    * ``async_loads``: loads leave the critical path (default True): a request whose prefix
      the daemon holds waits in vLLM (``WAITING_FOR_REMOTE_KVS``) while the workers copy it,
      and the other requests' steps go on; it is scheduled once the workers report its copy
      settled. False: every load is synchronous, done before the forward of the step that
      computes on it. Under async scheduling loads are asynchronous whatever this says: the
      next step is planned before vLLM hears that a synchronous load failed, and vLLM 0.32's
      recovery from that keeps a token sampled from the unfilled blocks.
    * ``sync_lone_loads``: with ``async_loads``, a request whose cached prefix is wholly in
      the daemon's L1 (by a lookup made in this step) loads synchronously when nothing else
      runs (no other request admitted and unfinished, no asynchronous load in flight)
      (default True): an asynchronous load is reported one step later than a synchronous
      one, which costs a lone request that step and spares no one anything
      (``retrieve_timing.py``). False: every load is asynchronous under ``async_loads``.
      Async scheduling makes every load asynchronous, whatever this says.
    * ``shared_memory``: on CPU, allocate vLLM's KV cache in sealed memfds so the daemon can map it
      (default True; without it the CPU worker cannot register).
    * ``lookup_batch``: how many requests one lookup round trip may ask about (default 32, at
      most ``MAX_LOOKUP_BATCH``): the first request of a step that needs a lookup takes the
      other requests vLLM added (or preempted) since with it, so a step that admits many
      requests asks the daemon once. 1: one lookup per request.
    * ``shared_loads``: a request whose prefix another admitted request is loading now
      (asynchronously) waits for that load and then finds the prefix in vLLM's own prefix
      cache, instead of copying the same chunks again (default True; ``shared_loads.py``).
    * ``consumer_store``: under ``kv_role=kv_consumer``, store anyway (default False: a decode
      instance only loads). ``kv_producer`` never loads (docs/disaggregation.md).
    * ``transfer_wait_s``: how long a decode instance's load waits at the daemon for the chunks
      the prefill instance named in ``kv_transfer_params`` (below ``timeout_s``; default 5, or
      half of ``timeout_s`` if that is less); what has not arrived by then is recomputed.
    """

    endpoint: str | None = None
    curve_server_key: str | None = None
    curve_secret_key: str | None = None
    instance_id: int | None = None
    model_name: str | None = None
    timeout_s: float = 10.0
    window: int = 32
    load: bool = True
    store: bool = True
    kv_format: str | None = None
    shared_memory: bool = True
    async_stores: bool = True
    async_loads: bool = True
    sync_lone_loads: bool = True
    lookup_batch: int = 32
    shared_loads: bool = True
    consumer_store: bool = False
    transfer_wait_s: float | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        # A switch given as "false" (a string) would be on: only true or false are taken.
        wrong = {f.name: extra[f.name] for f in fields(cls) if f.type == "bool" and f.name in extra}
        wrong = {k: v for k, v in wrong.items() if not isinstance(v, bool)}
        if wrong:
            raise ValueError(f"kv_connector_extra_config switches take true or false, got {wrong}")
        cfg = cls(**extra)
        if cfg.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {cfg.timeout_s}")
        if not 1 <= cfg.lookup_batch <= MAX_LOOKUP_BATCH:
            raise ValueError(f"lookup_batch must be in 1..{MAX_LOOKUP_BATCH}, got {cfg.lookup_batch}")
        if cfg.transfer_wait_s is not None and not 0 < cfg.transfer_wait_s < cfg.timeout_s:
            wait = cfg.transfer_wait_s
            raise ValueError(f"transfer_wait_s must be in (0, timeout_s={cfg.timeout_s}), got {wait}")
        if cfg.window < 1:
            raise ValueError(f"window must be >= 1, got {cfg.window}")
        if cfg.instance_id is not None and cfg.instance_id < 0:
            raise ValueError(f"instance_id must be >= 0, got {cfg.instance_id}")
        return cfg

    @property
    def transfer_wait(self) -> float:
        """``transfer_wait_s``, or its default (see the class docstring)."""
        return self.transfer_wait_s if self.transfer_wait_s is not None else min(5.0, self.timeout_s / 2)

    def resolve_instance_id(self, engine_id: str | None, rank: int = 0) -> int:
        """The daemon instance id of tensor-parallel ``rank`` of this engine."""
        if self.instance_id is not None:
            return self.instance_id + rank
        digest = hashlib.blake2b((engine_id or "vllm").encode(), digest_size=8).digest()
        base = int.from_bytes(digest, "little") % _MAX_INSTANCE_BASE
        return base * 64 + rank  # room for 64 ranks per engine

    def resolve_model_name(self, served: str, rank: int = 0, world_size: int = 1, replicas: int = 1) -> str:
        """The key scope of tensor-parallel ``rank`` (``TPGroup``): ranks holding different
        heads of the same shape get scopes of their own; ``replicas`` consecutive ranks that
        hold the same bytes (MLA's latent) share one, so a chunk is stored once for them."""
        return TPGroup(rank, world_size, replicas).model_name(self.model_name or served)


@dataclass(frozen=True, slots=True)
class TPGroup:
    """Which tensor-parallel ranks hold the same KV bytes, and which of them writes.

    vLLM 0.32 states it in ``KVCacheConfig.kv_tp_replicas``: the number of consecutive ranks
    holding identical KV for every layer (``world_size`` for an MLA model, whose latent cache
    is computed from replicated weights on every rank; 1 when each rank holds its own heads).
    Ranks ``[s * replicas, (s + 1) * replicas)`` form shard ``s``: they share one key scope,
    so every one of them reads the chunks of the shard, and only the first of them stores
    (``writes``), so L1 holds each chunk once instead of once per rank. A replica count that
    does not divide the world (no vLLM layout gives one) is taken as 1: per-rank scopes, a
    miss at worst, never one rank handed another's heads.
    """

    rank: int = 0
    world_size: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.world_size % self.replicas:
            object.__setattr__(self, "replicas", 1)

    @property
    def shard(self) -> int:
        """The index of the group of ranks holding this rank's bytes."""
        return self.rank // self.replicas

    @property
    def writes(self) -> bool:
        """Whether this rank stores: the first rank of its shard (every rank when unreplicated)."""
        return self.rank % self.replicas == 0

    def model_name(self, name: str) -> str:
        """``name`` scoped to this rank's shard: ``name`` alone at TP=1, ``name@tpRofN`` for rank
        R of N ranks with their own heads (the scope of every release so far), and
        ``name@tpSofGxR`` for shard S of G shards of R replicas each (MLA at TP=N: ``@tp0of1xN``).
        The world size is in every scope, so ranks of another TP size never read these chunks
        (their bytes differ in rounding: the all-reduces that feed each layer sum in another
        order); the chunk geometry and dtype the daemon adds keep other shapes apart too."""
        if self.world_size == 1:
            return name
        if self.replicas == 1:
            return f"{name}@tp{self.rank}of{self.world_size}"
        return f"{name}@tp{self.shard}of{self.world_size // self.replicas}x{self.replicas}"


def tp_rank_world() -> tuple[int, int]:
    """This process's tensor-parallel (rank, world size); (0, 1) without vLLM's distributed
    state (the scheduler process, a single process)."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:
        return 0, 1


__all__ = ["ConnectorConfig", "TPGroup", "tp_rank_world"]
