"""One daemon for the client tests that need no daemon of their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcache.server.launch import DaemonProcess
from tests.client.helpers import ARGS


@pytest.fixture(scope="package")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(ARGS)
    yield d
    assert d.stop() == 0, d.log
