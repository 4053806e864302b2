"""What a ``Register`` request must satisfy before the daemon maps an engine's memory.

Apart from ``handlers`` (which serves every request) because registering is the one request
that maps foreign memory: its checks (size limits, who handed the memfds over, tensor count
and nesting, format name) decide what the daemon's address space holds, and read best in one
place. ``Limits`` lives here as the bounds these checks and the handlers enforce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcache.errors import AccessDeniedError, LayoutError, LimitExceededError
from kvcache.protocol import messages as m
from kvcache.server.auth import Principal
from kvcache.server.fd_budget import DESCRIPTOR_HEADROOM, free_descriptors
from kvcache.transport.descriptors import descriptor_bytes
from kvcache.transport.tensors import ImportedTensor, import_tensor

if TYPE_CHECKING:
    from kvcache.transport.fdproto import ReceivedFds


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one client can make the daemon hold; each is a server flag.

    Hitting one is a ``LIMIT`` error reply and changes nothing."""

    max_instances: int = 256
    max_instances_per_client: int = 64
    """Instances one principal other than the operator may hold (at most ``max_instances`` - 1:
    a tenant, or every local user sharing plain loopback TCP, never takes every slot)."""
    max_tensors: int = 1024
    """KV tensors per registration (each is a mapping; vLLM uses one per layer)."""
    max_registration_bytes: int = 1 << 40
    """Engine memory one registration may map (1 TiB)."""
    max_ids: int = 1 << 22
    """Token ids, block ids or block hashes in one request (4 Mi: a 4M-token prompt)."""
    max_awaited_tokens: int = 1 << 26
    """Token ids one client's retrieves awaiting a prefill's chunks hold at once (64 Mi;
    ``server.budget``)."""
    max_awaiting_retrieves: int = 2048
    """Retrieves awaiting a prefill's chunks one client may have at once (``server.budget``):
    a decode instance awaits one per request it holds blocks for."""

    def __post_init__(self) -> None:
        for name in ("max_instances", "max_instances_per_client", "max_tensors", "max_registration_bytes",
                     "max_ids", "max_awaited_tokens", "max_awaiting_retrieves"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tensors > m.MAX_REGISTER_TENSORS:  # the wire refuses more before we see them
            raise ValueError(f"max_tensors must be <= {m.MAX_REGISTER_TENSORS}, got {self.max_tensors}")


def map_tensors(
    req: m.Register, principal: Principal, received: ReceivedFds | None, limits: Limits
) -> list[ImportedTensor]:
    """Check the registration and map its tensors; always closes ``received``.

    The descriptors can go once mapped (the mappings keep the memory), and a refused
    registration must not keep them either."""
    try:
        principal.check_model(req.model_name)
        check_registration_size(req, limits)
        ipc_user = principal.name.startswith("uid:")
        if received is not None and ipc_user and principal.name != f"uid:{received.uid}":
            # A ticket is a bearer secret; still, memory handed over by one local user is
            # registered by that user only.
            raise AccessDeniedError("the memory was handed over by another user")
        if received is None and any(isinstance(d, m.FdTensor) for d in req.tensors):
            raise LayoutError(
                "CPU tensors arrive as memfds over the daemon's fd socket; this request "
                "names none (fd_ticket empty, or the daemon has no fd socket)"
            )
        return [import_tensor(desc, received) for desc in req.tensors]
    finally:
        if received is not None:
            received.close()  # the mappings keep the memory; the descriptors can go


def check_registration_size(req: m.Register, lim: Limits) -> None:
    """Refuse a registration that would map more tensors, bytes or descriptors than allowed."""
    if len(req.tensors) > lim.max_tensors:
        raise LimitExceededError(
            f"{len(req.tensors)} KV tensors in one registration; the limit is "
            f"{lim.max_tensors} (--max-tensors)"
        )
    total = sum(descriptor_bytes(desc) for desc in req.tensors)
    if total > lim.max_registration_bytes:
        raise LimitExceededError(
            f"the registration maps {total} bytes; the limit is {lim.max_registration_bytes} "
            "(--max-registration-gb)"
        )
    # Each mapped CPU tensor keeps a descriptor open, and a memory map, for the registration's life.
    mapped = sum(isinstance(desc, m.FdTensor) for desc in req.tensors)
    if not mapped:
        return
    for what, free, headroom, remedy in (
        ("descriptors", free_descriptors(), DESCRIPTOR_HEADROOM, "the daemon's `ulimit -n`"),
        ("memory maps", free_memory_maps(), MAP_HEADROOM, "vm.max_map_count"),
    ):
        if free is not None and free - mapped < headroom:
            raise LimitExceededError(
                f"mapping {mapped} CPU tensors would leave the daemon short of {what} ({free} free, "
                f"{headroom} kept for its own use): register fewer, larger tensors, or raise {remedy}"
            )


MAP_HEADROOM = 8192
"""Memory maps kept for the daemon's own memory (L1 extents, libraries, thread stacks, the
allocator) when mapping tensors: past ``vm.max_map_count`` every ``mmap`` fails, its own
allocations included, and registered tensors are what a client can multiply (one map each)."""


def free_memory_maps() -> int | None:
    """Memory maps this process may still make (None where /proc cannot tell)."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit, open("/proc/self/maps", "rb") as maps:
            return int(limit.read()) - sum(1 for _ in maps)
    except (OSError, ValueError):
        return None


def rebuild_kv_caches(req: m.Register, tensors: list[torch.Tensor]) -> Any:
    """Give the mapped tensors the nesting the engine handed to the client."""
    if not tensors:
        raise LayoutError("a registration needs at least one KV tensor")
    if req.nesting == "tensor":
        if len(tensors) != 1:
            raise LayoutError(f"nesting 'tensor' needs exactly one tensor, got {len(tensors)}")
        return tensors[0]
    if req.nesting == "list":
        return tensors
    if sum(req.group_sizes) != len(tensors):
        raise LayoutError(f"group sizes {req.group_sizes} do not add up to {len(tensors)} tensors")
    groups, start = [], 0
    for size in req.group_sizes:
        groups.append(tensors[start : start + size])
        start += size
    return groups


def format_from_name(name: str | None) -> Any:
    """The ``KVFormat`` a registration names; None lets the engine detect it."""
    if name is None:
        return None
    from kvcache.layouts import KVFormat

    try:
        return KVFormat[name]
    except KeyError:
        raise LayoutError(f"unknown KV format {name!r}; known: {[f.name for f in KVFormat]}") from None


__all__ = [
    "Limits",
    "check_registration_size",
    "format_from_name",
    "map_tensors",
    "rebuild_kv_caches",
]
