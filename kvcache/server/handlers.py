"""One handler per daemon request: decode-free, socket-free calls into the ``CacheEngine``.

Kept apart from the ROUTER loop so that each operation can be read (and tested) as a plain
function of a request Struct, and so that the loop knows nothing about caching. Handlers run
on worker threads; the engine is thread-safe, the registry is locked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from kvcache.errors import LayoutError
from kvcache.protocol import messages as m
from kvcache.protocol.codec import unpack_ids
from kvcache.protocol.errors import error_from_exception
from kvcache.server import ipc
from kvcache.server.registry import Instance, InstanceRegistry

if TYPE_CHECKING:
    from kvcache.engine.engine import CacheEngine

log = logging.getLogger("kvcache.server")


class Handlers:
    """Serves decoded requests; ``handle`` never raises (errors become ``Error`` replies)."""

    def __init__(
        self, engine: CacheEngine, registry: InstanceRegistry, heartbeat_timeout_s: float
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.started = time.monotonic()
        self._table: dict[type, Callable[[Any], m.ReplyBody]] = {
            m.Register: self.register,
            m.Unregister: self.unregister,
            m.Lookup: self.lookup,
            m.Store: self.store,
            m.Retrieve: self.retrieve,
            m.ReportBlockAllocations: self.report_block_allocations,
            m.EndSession: self.end_session,
            m.Status: self.status,
            m.Ping: self.ping,
        }

    def handle(self, body: m.RequestBody) -> m.ReplyBody:
        try:
            return self._table[type(body)](body)
        except Exception as exc:  # every failure becomes a typed reply, never a dead worker
            error = error_from_exception(exc)
            if error.code is m.ErrorCode.INTERNAL:
                log.exception("internal error serving %s", type(body).__name__)
            return error

    # -- registration ------------------------------------------------------------------

    def register(self, req: m.Register) -> m.ReplyBody:
        imported = [ipc.import_tensor(desc) for desc in req.tensors]
        kv_caches = _rebuild(req, [t.tensor for t in imported])
        fmt = _format_from_name(req.fmt)
        if req.instance_id in self.registry:
            log.warning("instance %d registered again; replacing its caches", req.instance_id)
            self._release(req.instance_id)
        ctx = self.engine.register(
            req.instance_id,
            req.model_name,
            kv_caches,
            engine=req.engine,
            fmt=fmt,
            block_size=req.block_size,
        )
        device = str(imported[0].tensor.device)
        self.registry.add(Instance(req.instance_id, req.model_name, device, imported))
        log.info(
            "registered instance %d (%s): %s, %d layers x %d blocks of %d tokens on %s",
            req.instance_id, req.model_name, ctx.format.name, ctx.num_layers, ctx.num_blocks,
            ctx.block_size, device,
        )  # fmt: skip
        return m.Registered(
            instance_id=req.instance_id,
            num_layers=ctx.num_layers,
            num_blocks=ctx.num_blocks,
            block_size=ctx.block_size,
            chunk_size=ctx.chunk_size,
            fmt=ctx.format.name,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
        )

    def unregister(self, req: m.Unregister) -> m.ReplyBody:
        self.registry.get(req.instance_id)
        self._release(req.instance_id)
        return m.Done()

    def reap(self, instance: Instance) -> None:
        """Release an instance the registry already dropped for missing heartbeats."""
        log.warning(
            "instance %d (%s) sent nothing for %.1f s; releasing its registration",
            instance.instance_id, instance.model_name, self.heartbeat_timeout_s,
        )  # fmt: skip
        self._unregister_engine(instance.instance_id)
        self._remove_orphans(instance)

    def _release(self, instance_id: int) -> None:
        instance = self.registry.remove(instance_id)
        self._unregister_engine(instance_id)
        if instance is not None:
            self._remove_orphans(instance)

    def _unregister_engine(self, instance_id: int) -> None:
        with contextlib.suppress(KeyError):  # the engine never accepted it (a failed register)
            self.engine.unregister(instance_id)

    @staticmethod
    def _remove_orphans(instance: Instance) -> None:
        for path in {(t.path, t.owner_pid) for t in instance.tensors if t.path}:
            if ipc.remove_orphaned_segment(*path):
                log.info("removed %s left behind by exited pid %d", *path)

    # -- data path ---------------------------------------------------------------------

    def lookup(self, req: m.Lookup) -> m.ReplyBody:
        self.registry.get(req.instance_id)
        hit = self.engine.lookup(
            req.instance_id,
            _ids(req.token_ids),
            cache_salt=req.cache_salt,
            request_id=req.request_id,
        )
        return m.LookupResult(hit_tokens=hit)

    def store(self, req: m.Store) -> m.ReplyBody:
        instance = self.registry.get(req.instance_id)
        if req.cuda_event is not None:
            ipc.wait_ipc_event(req.cuda_event, torch.device(instance.device))
        result = self.engine.store(
            req.instance_id,
            _ids(req.token_ids),
            _ids(req.block_ids),
            cache_salt=req.cache_salt,
            request_id=req.request_id,
            block_hashes=req.block_hashes,
        )
        return m.StoreResult(
            stored_chunks=result.stored_chunks,
            skipped_chunks=result.skipped_chunks,
            failed_chunks=result.failed_chunks,
            stored_tokens=result.stored_tokens,
        )

    def retrieve(self, req: m.Retrieve) -> m.ReplyBody:
        instance = self.registry.get(req.instance_id)
        got = self.engine.retrieve(
            req.instance_id,
            _ids(req.token_ids),
            _ids(req.block_ids),
            req.skip_tokens,
            cache_salt=req.cache_salt,
            request_id=req.request_id,
        )
        event = None
        if instance.device.startswith("cuda"):
            # The engine's copy has finished when retrieve returns (it frees the L1 slots right
            # after); the event keeps the engine's side ordered should that ever become async.
            event = ipc.record_ipc_event(torch.device(instance.device))
        return m.RetrieveResult(retrieved_tokens=got, cuda_event=event)

    def report_block_allocations(self, req: m.ReportBlockAllocations) -> m.ReplyBody:
        self.registry.get(req.instance_id)
        self.engine.report_block_allocations(req.instance_id, req.records)
        return m.Done()

    def end_session(self, req: m.EndSession) -> m.ReplyBody:
        self.registry.get(req.instance_id)
        self.engine.end_session(req.instance_id, req.request_id)
        return m.Done()

    # -- health ------------------------------------------------------------------------

    def status(self, req: m.Status) -> m.ReplyBody:
        engine_status = msgspec.to_builtins(self.engine.status(), enc_hook=str, str_keys=True)
        return m.StatusResult(
            protocol_version=m.PROTOCOL_VERSION,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self.started,
            instances=self.registry.ids(),
            engine=engine_status,
            in_flight=self.registry.in_flight(),
        )

    def ping(self, req: m.Ping) -> m.ReplyBody:
        registered = req.instance_id is not None and self.registry.touch(req.instance_id)
        return m.Pong(protocol_version=m.PROTOCOL_VERSION, registered=registered)


def _ids(ids: m.IdArray) -> np.ndarray:
    return unpack_ids(ids)


def _rebuild(req: m.Register, tensors: list[torch.Tensor]) -> Any:
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


def _format_from_name(name: str | None) -> Any:
    if name is None:
        return None
    from kvcache.layouts import GPUKVFormat

    try:
        return GPUKVFormat[name]
    except KeyError:
        raise LayoutError(
            f"unknown KV format {name!r}; known: {[f.name for f in GPUKVFormat]}"
        ) from None


__all__ = ["Handlers"]
