"""Lock-free Prometheus instruments written by the dispatcher thread, read at scrape time.

Separate from the subscribers because every subscriber needs the same three shapes
(counter, gauge, histogram) and because ``prometheus_client``'s own instruments take a lock
per update (~0.3 µs for ``inc``, ~1 µs for ``observe`` on the target machines), which alone
would cap dispatch far below the 300k events/s budget. Here an update is a plain attribute
add; a ``MetricSet`` is a ``prometheus_client`` custom collector that builds the exposition
families when the registry is collected.

Threading contract: exactly one thread (the bus dispatcher) writes; any thread may collect.
A scrape can observe a histogram mid-update (``_sum`` one observation behind its buckets);
``_count`` is always derived from the buckets so the ``+Inf == _count`` invariant holds.

Labelled families: a labelled family has no samples until a label set is first used; its
``# HELP``/``# TYPE`` lines are always exposed. Subscribers create every series of a label
set together, at zero, the first time they see that label set (see METRICS.md).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class Counter:
    """A monotonically increasing value; ``inc`` with a negative amount is a caller bug."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Gauge:
    """A value that is set, not accumulated."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0.0

    def set(self, value: float) -> None:
        self.value = value


class Histogram:
    """Fixed-bucket histogram; ``counts[i]`` holds observations in (bounds[i-1], bounds[i]]."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above the highest bound (+Inf)
        self.sum: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


Instrument = Counter | Gauge | Histogram


class Family:
    """One metric name: its kind, help, label names and the series created so far."""

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] | None = None,
    ) -> None:
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"unknown metric kind {kind!r}")
        if kind == "counter" and not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end with _total")
        if kind == "histogram":
            if not buckets:
                raise ValueError(f"histogram {name!r} needs explicit buckets")
            if list(buckets) != sorted(set(buckets)):
                raise ValueError(f"histogram {name!r} buckets must be strictly increasing")
        self.name = name
        self.documentation = documentation
        self.kind = kind
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets or ())
        self.series: dict[tuple[str, ...], Instrument] = {}
        if not self.labelnames:
            self.labels()

    def labels(self, *values: str) -> Instrument:
        """Return the series for ``values``, creating it at zero on first use."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        series = self.series.get(values)
        if series is None:
            series = self._new()
            self.series[values] = series
        return series

    def remove(self, *values: str) -> None:
        """Forget the series for ``values`` (no longer exposed); absent is fine."""
        self.series.pop(values, None)

    def counter(self, *values: str) -> Counter:
        inst = self.labels(*values)
        assert isinstance(inst, Counter), self.name
        return inst

    def gauge(self, *values: str) -> Gauge:
        inst = self.labels(*values)
        assert isinstance(inst, Gauge), self.name
        return inst

    def histogram(self, *values: str) -> Histogram:
        inst = self.labels(*values)
        assert isinstance(inst, Histogram), self.name
        return inst

    def _new(self) -> Instrument:
        if self.kind == "counter":
            return Counter()
        if self.kind == "gauge":
            return Gauge()
        return Histogram(self.buckets)

    def exposition_names(self) -> list[str]:
        """Every sample name this family can expose (what a scraper sees)."""
        if self.kind == "histogram":
            return [f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum"]
        return [self.name]

    def collect(self) -> Metric:
        labelnames = list(self.labelnames)
        series = list(self.series.items())  # copy: the dispatcher may add series meanwhile
        if self.kind == "counter":
            counter = CounterMetricFamily(self.name, self.documentation, labels=labelnames)
            for values, inst in series:
                assert isinstance(inst, Counter)
                counter.add_metric(list(values), inst.value)
            return counter
        if self.kind == "gauge":
            gauge = GaugeMetricFamily(self.name, self.documentation, labels=labelnames)
            for values, inst in series:
                assert isinstance(inst, Gauge)
                gauge.add_metric(list(values), inst.value)
            return gauge
        hist = HistogramMetricFamily(self.name, self.documentation, labels=labelnames)
        for values, inst in series:
            assert isinstance(inst, Histogram)
            counts = list(inst.counts)
            cumulative, running = [], 0
            for bound, n in zip((*inst.bounds, float("inf")), counts, strict=True):
                running += n
                cumulative.append((floatToGoString(bound), running))
            hist.add_metric(list(values), cumulative, inst.sum)
        return hist


class MetricSet(Collector):
    """The families one component owns, exposed to a registry as one custom collector."""

    def __init__(self) -> None:
        self._families: list[Family] = []
        self._registry: CollectorRegistry | None = None
        self._refreshers: list[Callable[[], None]] = []

    def on_collect(self, refresh: Callable[[], None]) -> None:
        """Run ``refresh`` before every collection (for values read, not accumulated)."""
        self._refreshers.append(refresh)

    def add(
        self,
        name: str,
        documentation: str,
        kind: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] | None = None,
    ) -> Family:
        family = Family(name, documentation, kind, labelnames, buckets)
        self._families.append(family)
        return family

    def counter(self, name: str, documentation: str) -> Counter:
        return self.add(name, documentation, "counter").counter()

    def gauge(self, name: str, documentation: str) -> Gauge:
        return self.add(name, documentation, "gauge").gauge()

    def histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        return self.add(name, documentation, "histogram", buckets=buckets).histogram()

    @property
    def families(self) -> tuple[Family, ...]:
        return tuple(self._families)

    def register(self, registry: CollectorRegistry) -> None:
        """Expose the families; a name clash with another collector raises ``ValueError``."""
        registry.register(self)
        self._registry = registry

    def unregister(self) -> None:
        if self._registry is not None:
            self._registry.unregister(self)
            self._registry = None

    def describe(self) -> Iterable[Metric]:
        return [f.collect() for f in self._families]

    def collect(self) -> Iterator[Metric]:
        for refresh in self._refreshers:
            refresh()
        for family in self._families:
            yield family.collect()


# Bucket sets shared by several subscribers, each fitting its unit (design §5, lesson 8).
OPERATION_SECONDS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
TRANSFER_BYTES = tuple(float(2**i) for i in range(16, 35, 2))  # 64 KiB .. 16 GiB, x4
# Bytes per second, readable as GB/s: 0.1, 0.25, ... 200 GB/s (PCIe 4/5, NVLink, HBM copies).
THROUGHPUT_BYTES_PER_SECOND = tuple(
    g * 1e9 for g in (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 25.0, 50.0, 100.0, 200.0)
)
LIFETIME_SECONDS = (
    0.1,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
    7200.0,
    21600.0,
    86400.0,
)
LAG_SECONDS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


MAX_INSTANCE_LABEL_SETS = 1024
"""(instance_id, model_name) label sets a per-instance subscriber exposes at once: a set
reported by an instance that left stays (its last figures reach the next scrape) until this
many newer ones push it out, least recently reported first, so engines that come and go
(restarts, new instance ids) never grow the exposition, or the daemon, without bound. A
daemon holds at most 256 live instances (``--max-instances``)."""


class LabelSetCap:
    """The label sets in use, least recently reported first; ``touch`` says which one to
    drop (its series removed from every family) once more than ``cap`` are in use."""

    def __init__(self, cap: int = MAX_INSTANCE_LABEL_SETS) -> None:
        self.cap = cap
        self._order: OrderedDict[tuple[object, object], None] = OrderedDict()

    def touch(self, key: tuple[object, object]) -> tuple[object, object] | None:
        """``key`` was reported now; the label set to drop, if one must go."""
        self._order[key] = None
        self._order.move_to_end(key)
        if len(self._order) <= self.cap:
            return None
        oldest, _ = self._order.popitem(last=False)
        return oldest


__all__ = [
    "LAG_SECONDS",
    "LIFETIME_SECONDS",
    "MAX_INSTANCE_LABEL_SETS",
    "OPERATION_SECONDS",
    "THROUGHPUT_BYTES_PER_SECOND",
    "TRANSFER_BYTES",
    "Counter",
    "Family",
    "Gauge",
    "Histogram",
    "LabelSetCap",
    "MetricSet",
]
