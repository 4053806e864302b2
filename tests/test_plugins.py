"""Plug-in subscribers: loading by module:Class with JSON config, isolation of slow/failing ones."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcache.config import ConfigError
from kvcache.observability.bus import Callback, EventBus, EventSubscriber
from kvcache.observability.event import Event, EventType
from kvcache.plugins import (
    IsolatedSubscriber,
    add_plugin_args,
    load_plugin_subscribers,
    load_subscriber,
    subscribers_from_args,
)
from tests.helpers import event

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


class Blocking(EventSubscriber):
    """Blocks on its first event until released: a plug-in that is as slow as we like."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen = 0

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.MP_STORE_END: self.on}

    def on(self, event: Event) -> None:
        self.release.wait(10)
        self.seen += 1


class Raising(EventSubscriber):
    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.MP_STORE_END: self.on}

    def on(self, event: Event) -> None:
        raise RuntimeError("plug-in bug")


class Recorder(EventSubscriber):
    def __init__(self) -> None:
        self.n = 0

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.MP_STORE_END: self.on}

    def on(self, event: Event) -> None:
        self.n += 1


def store_end(model: str = "m", stored: int = 256) -> Event:
    return event(EventType.MP_STORE_END, {"instance_id": 0, "model_name": model, "stored_tokens": stored})


def test_example_plugin_loads_with_config_and_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    reg = CollectorRegistry()
    parser = add_plugin_args(argparse.ArgumentParser())
    argv = ["--subscriber", "my_subscriber:TokenTally", "--subscriber-config", '{"log_every": 1}']
    ns = parser.parse_args(argv)
    (sub,) = subscribers_from_args(ns, reg)
    bus = EventBus(registry=reg)
    bus.register_subscriber(sub)
    with bus:
        bus.publish(store_end("a", 256))
        bus.publish(event(EventType.MP_RETRIEVE_END, {"model_name": "a", "retrieved_tokens": 512}))
        assert bus.flush(5) and sub.join(5)
    tally = sub.inner
    assert tally.log_every == 1  # type: ignore[attr-defined]
    assert tally.stored == {"a": 256} and tally.retrieved == {"a": 512}  # type: ignore[attr-defined]
    assert reg.get_sample_value("my_retrieved_tokens_total", {"model_name": "a"}) == 512
    assert reg.get_sample_value("kvcache_plugin_dropped_events_total", {"subscriber": "TokenTally"}) == 0


def test_slow_plugin_never_delays_the_bus_and_its_losses_are_counted() -> None:
    reg = CollectorRegistry()
    slow = IsolatedSubscriber(Blocking(), max_queue_size=4)
    fast = Recorder()
    bus = EventBus(registry=reg)
    bus.register_subscriber(slow)
    bus.register_subscriber(fast)
    with bus:
        for _ in range(50):
            bus.publish(store_end())
        assert bus.flush(5)  # returns although the plug-in is stuck on its first event
        assert fast.n == 50
        assert slow.dropped >= 50 - 1 - 4
        slow.inner.release.set()  # type: ignore[attr-defined]
        assert slow.join(5)
    assert slow.inner.seen == 50 - slow.dropped  # type: ignore[attr-defined]


def test_raising_plugin_is_counted_and_others_still_get_events() -> None:
    reg = CollectorRegistry()
    bad = load_plugin_subscribers(["tests.test_plugins:Raising"], registry=reg)[0]
    good = Recorder()
    bus = EventBus(registry=reg)
    bus.register_subscriber(bad)
    bus.register_subscriber(good)
    with bus:
        for _ in range(3):
            bus.publish(store_end())
        assert bus.flush(5) and bad.join(5)
    assert (bad.errors, good.n) == (3, 3)
    assert reg.get_sample_value("kvcache_plugin_errors_total", {"subscriber": "Raising"}) == 3
    assert bus.subscriber_errors("Raising") == 0  # never reached the bus


@pytest.mark.parametrize(
    ("spec", "config", "match"),
    [
        ("nocolon", {}, "module:Class"),
        ("no_such_module_xyz:C", {}, "cannot import"),
        ("tests.test_plugins:Missing", {}, "has no"),
        ("tests.test_plugins:store_end", {}, "not a kvcache"),
        ("tests.test_plugins:Recorder", {"bogus": 1}, "bad --subscriber-config"),
    ],
)
def test_load_errors_name_the_spec(spec: str, config: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_subscriber(spec, config)


def test_flag_parsing_and_config_count() -> None:
    parser = add_plugin_args(argparse.ArgumentParser())
    assert parser.parse_args([]).subscriber == []
    with pytest.raises(SystemExit):
        parser.parse_args(["--subscriber-config", "[1]"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--subscriber-config", "{nope"])
    with pytest.raises(ConfigError, match="2 --subscriber-config"):
        load_plugin_subscribers(["tests.test_plugins:Recorder"], [{}, {}])
    subs = load_plugin_subscribers(["tests.test_plugins:Recorder", "tests.test_plugins:Recorder"], [{}])
    assert [s.name for s in subs] == ["Recorder", "Recorder"]
    for s in subs:
        s.shutdown()
