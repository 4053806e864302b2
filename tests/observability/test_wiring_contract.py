"""No hidden globals on the observability side: the event vocabulary imports light, and no
constructor registers metrics in prometheus_client's process-wide registry on its own."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import kvcache.observability.subscribers as subscribers
from kvcache.observability.bus import EventBus
from kvcache.observability.runtime import ObservabilityConfig, init_observability


def test_importing_the_event_vocabulary_loads_neither_the_bus_nor_prometheus() -> None:
    """A data-path module imports ``event`` to publish; that must not pull in the bus, the
    runtime or prometheus_client (the transfer core runs where those are absent)."""
    code = (
        "import sys, kvcache.observability.event as e; "
        "e.Event(e.EventType.L1_CLEARED, e.L1Cleared(num_keys=0)); "
        "print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', "
        "'kvcache.observability.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['kvcache.observability.event']"


def _classes_taking_a_registry() -> list[type]:
    found: list[type] = [EventBus]
    for info in pkgutil.walk_packages(subscribers.__path__, subscribers.__name__ + "."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and "registry" in inspect.signature(cls).parameters:
                found.append(cls)
    return found


def test_no_constructor_defaults_to_a_process_wide_registry() -> None:
    classes = _classes_taking_a_registry()
    assert len(classes) >= 8  # the bus, the metric and lifecycle subscribers (and more)
    defaulted = [
        cls.__qualname__
        for cls in classes
        if inspect.signature(cls).parameters["registry"].default is not inspect.Parameter.empty
    ]
    assert not defaulted, f"registry must be passed by the entry point: {defaulted}"


def test_two_observability_stacks_live_side_by_side_in_one_process() -> None:
    """Each ``init_observability`` owns its registry: a second one (a test, a second engine in
    the process) never collides with the first (prometheus_client's DuplicateTimeseries)."""
    first = init_observability(ObservabilityConfig(prometheus_port=None, metrics_sample_rate=1.0))
    second = init_observability(ObservabilityConfig(prometheus_port=None, metrics_sample_rate=1.0))
    try:
        assert first.registry is not second.registry
    finally:
        second.shutdown()
        first.shutdown()
