"""Fixtures for the daemon tests: real ``python -m kvcache.server`` processes, real sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvcache.server.launch import DaemonProcess, Spawn
from tests.helpers import daemon_starter

from .helpers import BASE_ARGS


@pytest.fixture
def start_daemon(daemon_spawn: Spawn | None) -> Iterator[Callable[..., DaemonProcess]]:
    """Factory for daemons that are killed when the test ends."""
    yield from daemon_starter(BASE_ARGS, daemon_spawn)


@pytest.fixture(scope="module")
def shared_daemon(daemon_spawn: Spawn | None) -> Iterator[DaemonProcess]:
    """One daemon for the tests that only need one: a 1 s heartbeat, 1 MiB message limit."""
    d = DaemonProcess([*BASE_ARGS, "--heartbeat-timeout", "1.0", "--max-message-mb", "1"], spawn=daemon_spawn)
    yield d
    assert d.stop() == 0, d.log
    d.remove_runtime_dir()
