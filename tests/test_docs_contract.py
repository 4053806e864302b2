"""EVENTS.md and METRICS.md match the code, both ways (the way httpx checks ``__all__``).

Every EventType has a section in EVENTS.md and every section names a real EventType; each
section's key table lists exactly its metadata Struct's fields (name and type, in order). Every
metric the process exposes has a row in METRICS.md with the right type, labels and buckets,
and every row names a metric the process exposes.
"""

from __future__ import annotations

import ast
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from kvcache.kv_events.publisher import NullEventPublisher
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.observability import EventType, ObservabilityConfig, init_observability
from kvcache.observability.event import EVENT_META
from kvcache.observability.instruments import Family, MetricSet
from kvcache.plugins import _plugin_metrics, load_plugin_subscribers

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    name: str
    kind: str
    labels: tuple[str, ...]
    buckets: str
    promql: str


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def documented_metrics() -> tuple[dict[str, Row], dict[str, tuple[float, ...]]]:
    text = (ROOT / "METRICS.md").read_text()
    rows: dict[str, Row] = {}
    bucket_sets: dict[str, tuple[float, ...]] = {}
    for line in text.splitlines():
        if line.startswith("| `kvcache_"):
            c = _cells(line)
            assert len(c) == 9, f"METRICS.md row needs 9 columns: {line}"
            name = c[0].strip("`")
            assert name not in rows, f"{name} documented twice"
            labels = () if c[3] == "-" else tuple(x.strip() for x in c[3].split(","))
            rows[name] = Row(name, c[1], labels, c[4], c[8])
        elif re.match(r"\| [A-Z_]+ \| \[", line):
            c = _cells(line)
            bucket_sets[c[0]] = tuple(float(x) for x in ast.literal_eval(c[1]))
    return rows, bucket_sets


def exposed_families() -> dict[str, Family]:
    """Every family a fully enabled process registers, by exposition name."""
    registry = CollectorRegistry()
    cfg = ObservabilityConfig(prometheus_port=None, logging=False)
    obs = init_observability(cfg, registry=registry)
    try:
        sets: list[MetricSet] = [obs.bus.metrics]  # type: ignore[union-attr]
        for subscriber in obs.subscribers:
            metrics = getattr(subscriber, "metrics", None)
            if isinstance(metrics, MetricSet):
                sets.append(metrics)
        # Optional pieces the daemon adds by flag: KV events and third-party plug-ins.
        kv_events = KVEventsSubscriber(NullEventPublisher(), chunk_size=256, registry=registry)
        sets.append(kv_events.metrics)
        plugins = load_plugin_subscribers(["tests.test_plugins:Recorder"], registry=registry)
        for plugin in plugins:
            plugin.shutdown()
        sets.append(_plugin_metrics(plugins))
        families = {f.name: f for m in sets for f in m.families}
        # Nothing else is registered: the registry exposes exactly these families.
        registered = {
            (fam.name + "_total" if fam.type == "counter" else fam.name) for fam in registry.collect()
        }
        assert registered == set(families)
    finally:
        obs.shutdown()
    return families


def test_every_exposed_metric_is_documented_and_vice_versa() -> None:
    rows, _ = documented_metrics()
    exposed = exposed_families()
    missing = sorted(set(exposed) - set(rows))
    stale = sorted(set(rows) - set(exposed))
    assert not missing, f"exposed but not in METRICS.md: {missing}"
    assert not stale, f"in METRICS.md but not exposed: {stale}"


def test_documented_type_labels_and_buckets_match() -> None:
    rows, bucket_sets = documented_metrics()
    for name, family in exposed_families().items():
        row = rows[name]
        assert row.kind == family.kind, name
        assert row.labels == family.labelnames, name
        if family.kind == "histogram":
            assert row.buckets in bucket_sets, f"{name}: unknown bucket set {row.buckets}"
            assert bucket_sets[row.buckets] == family.buckets, name
        else:
            assert row.buckets == "-", name
        assert name in row.promql, f"{name}: example PromQL does not use the metric"


@pytest.mark.parametrize("doc", ["METRICS.md", "EVENTS.md"])
def test_doc_exists(doc: str) -> None:
    assert (ROOT / doc).is_file()


def documented_events() -> dict[str, str]:
    text = (ROOT / "EVENTS.md").read_text()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    events: dict[str, str] = {}
    for section in sections:
        m = re.match(r"([A-Z0-9_]+) \(`([a-z0-9_.]+)`\)\n", section)
        assert m, f"EVENTS.md section heading must read 'NAME (`value`)': {section[:60]!r}"
        assert "| key | type | meaning |" in section, f"{m.group(1)}: no metadata table"
        assert m.group(1) not in events, f"{m.group(1)} documented twice"
        events[m.group(1)] = m.group(2)
    return events


def test_every_event_type_is_documented_and_vice_versa() -> None:
    documented = documented_events()
    actual = {e.name: e.value for e in EventType}
    assert sorted(set(actual) - set(documented)) == [], "EventTypes missing from EVENTS.md"
    assert sorted(set(documented) - set(actual)) == [], "EVENTS.md names unknown EventTypes"
    assert documented == actual, "EVENTS.md values differ from EventType values"


def _type_name(tp: object) -> str:
    """A field type as EVENTS.md spells it: ``int``, ``list[int | None]``, ``list[ChunkIdentity]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is types.UnionType or origin is typing.Union:
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "None" if tp is type(None) else tp.__name__  # type: ignore[attr-defined]


def documented_keys() -> dict[str, list[tuple[str, str, bool]]]:
    """Per EventType name, its EVENTS.md key table as (key, type, optional) rows, in order;
    a row is optional when its meaning starts with "optional"."""
    text = (ROOT / "EVENTS.md").read_text()
    tables: dict[str, list[tuple[str, str, bool]]] = {}
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        rows = []
        for line in section.split("| key | type | meaning |", 1)[1].splitlines()[2:]:
            if not line.startswith("|"):
                break
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            rows.append((cells[0], cells[1], cells[2].startswith("optional")))
        tables[section.split(" ", 1)[0]] = rows
    return tables


def test_every_metadata_table_matches_its_struct_and_vice_versa() -> None:
    """A key renamed, retyped, reordered, added or dropped on either side fails here, not in
    a subscriber that silently reads 0; a key is optional in EVENTS.md exactly when its
    Struct field has a default."""
    documented = documented_keys()
    assert set(EVENT_META) == set(EventType), "every EventType needs a metadata Struct"
    for event_type, cls in EVENT_META.items():
        fields = [(f.name, _type_name(f.type), not f.required) for f in msgspec.structs.fields(cls)]
        assert documented[event_type.name] == fields, f"{event_type.name}: EVENTS.md vs {cls.__name__}"


def test_vllm_side_metrics_table_matches_the_connector() -> None:
    """The METRICS.md rows for vLLM's /metrics name exactly the series the connector registers
    (read from ``stats`` so this runs without vLLM), with their types."""
    from kvcache.integrations.vllm.stats import HIT_SERIES, PROM_SERIES

    documented = {
        _cells(line)[0].strip("`"): _cells(line)[1]
        for line in (ROOT / "METRICS.md").read_text().splitlines()
        if line.startswith("| `vllm:")
    }
    registered = {name: kind for name, kind, _doc, _key in PROM_SERIES} | {HIT_SERIES[0]: "counter"}
    assert documented == registered
