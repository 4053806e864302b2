"""CUDA interprocess events: how a store or retrieve orders GPU work across two processes.

Separate from ``cuda_ipc`` (the tensors) because an event travels with every request while a
tensor is exported once, at registration, and the two share no code. The engine records an
event and keeps it alive (``record_ipc_event``, ``EventKeeper``); the daemon opens it and
orders its copy stream after it (``open_ipc_event``); a caller with no stream of its own
blocks on it (``wait_ipc_event``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.transfer.validate import cuda_errors


@dataclass(frozen=True)
class ExportedEvent:
    """An interprocess CUDA event and the handle sent for it.

    The exporting process must keep ``event`` alive for as long as the peer may use the
    handle: operating on an imported event after the exporter destroyed it is undefined
    behaviour (CUDA IPC documentation, ``cudaIpcOpenEventHandle``). ``EventKeeper`` holds it.
    """

    event: Any
    handle: bytes


def record_ipc_event(device: torch.device) -> ExportedEvent:
    """Record an interprocess event on ``device``'s current stream. Keep the result alive
    (``EventKeeper``) until the peer has waited on it."""
    with cuda_errors("recording an interprocess CUDA event"):
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))
        return ExportedEvent(event, bytes(event.ipc_handle()))


class EventKeeper:
    """Keeps exported events alive while their requests are in flight, and a while after.

    ``hold`` when the handle is sent; ``release`` when the reply arrived (the daemon waits
    on a store's event before it answers) or the call gave up. A released event stays in a
    ring of the last ``linger`` ones: a request the client stopped waiting for may still be
    read by the daemon (one that reached it just before its deadline), and its event must
    not be destroyed under it. Thread-safe through the GIL-atomic deque and dict operations.
    """

    def __init__(self, linger: int = 256) -> None:
        self._held: dict[int, ExportedEvent] = {}
        self._recent: deque[ExportedEvent] = deque(maxlen=linger)

    def hold(self, exported: ExportedEvent) -> None:
        self._held[id(exported)] = exported

    def release(self, exported: ExportedEvent) -> None:
        if self._held.pop(id(exported), None) is not None:
            self._recent.append(exported)

    def __len__(self) -> int:
        """Events alive through this keeper (held or lingering)."""
        return len(self._held) + len(self._recent)


def open_ipc_event(handle: bytes, device: torch.device) -> Any:
    """The ``torch.cuda.Event`` another process recorded and exported as ``handle``.

    The daemon hands a store's event to its copies (``TransferJob.after``): the copy stream
    waits for it on the device, so no daemon thread blocks on the engine's GPU work. Keep the
    result referenced while a stream may wait on it (the job holds it); closing the imported
    event under a pending wait is not defined by CUDA.
    """
    with cuda_errors("opening the peer's CUDA IPC event"):
        return torch.cuda.Event.from_ipc_handle(device, handle)


def wait_ipc_event(handle: bytes, device: torch.device) -> None:
    """Block the calling thread until an event another process recorded has completed.

    NOTE: a host wait, for a caller with no copy of its own to order after the event (the
    client, on a retrieve reply's event); the daemon orders its copies on the device instead
    (``open_ipc_event``).
    """
    event = open_ipc_event(handle, device)
    with cuda_errors("waiting on the peer's CUDA IPC event"):
        event.synchronize()


__all__ = ["EventKeeper", "ExportedEvent", "open_ipc_event", "record_ipc_event", "wait_ipc_event"]
