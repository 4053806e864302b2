"""The Grafana dashboard: valid JSON, every query names a metric the process really exposes
(read from a live registry) and documented in METRICS.md, and every query parses (promtool)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcache.kv_events.publisher import NullEventPublisher
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.observability import ObservabilityConfig, init_observability
from kvcache.observability.instruments import MetricSet
from kvcache.plugins import load_plugin_subscribers

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "kvcache-dashboard.json"
METRIC = re.compile(r"\bkvcache_[a-z0-9_]+")


def expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def live_metric_names() -> set[str]:
    """Exposition names (``_bucket``/``_count``/``_sum`` included) of a fully enabled process."""
    reg = CollectorRegistry()
    obs = init_observability(ObservabilityConfig(prometheus_port=None, logging=False), registry=reg)
    try:
        sets: list[MetricSet] = [obs.bus.metrics]  # type: ignore[union-attr]
        sets += [s.metrics for s in obs.subscribers if isinstance(getattr(s, "metrics", None), MetricSet)]
        sets.append(KVEventsSubscriber(NullEventPublisher(), chunk_size=256, registry=reg).metrics)
        plugins = load_plugin_subscribers(["tests.test_plugins:Recorder"], registry=reg)
        for p in plugins:
            p.shutdown()
        names = {n for m in sets for f in m.families for n in f.exposition_names()}
        names |= {"kvcache_plugin_dropped_events_total", "kvcache_plugin_errors_total"}
        scraped = {s.name for fam in reg.collect() for s in fam.samples}
        assert "kvcache_plugin_errors_total" in scraped  # really registered
        return names
    finally:
        obs.shutdown()


def documented_names() -> set[str]:
    text = (ROOT / "METRICS.md").read_text()
    return {m.group(1) for m in re.finditer(r"^\| `(kvcache_[a-z0-9_]+)`", text, flags=re.M)}


def family(name: str) -> str:
    return re.sub(r"_(bucket|count|sum)$", "", name)


def test_dashboard_is_grafana_json_with_queries() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert all(p["targets"] and all(t["expr"].strip() for t in p["targets"]) for p in dash["panels"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("tier", "throughput", "latency", "l1 usage", "lifetime", "bus"):
        assert topic in titles, topic


def test_every_expression_names_an_exposed_and_documented_metric() -> None:
    live = live_metric_names()
    documented = documented_names()
    used = {m for e in expressions() for m in METRIC.findall(e)}
    assert used, "no metric found in the dashboard"
    assert sorted(used - live) == [], "dashboard uses metrics the process does not expose"
    assert sorted({family(m) for m in used} - documented) == [], "dashboard uses undocumented metrics"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_every_expression_parses(tmp_path: Path) -> None:
    rules = []
    for i, expr in enumerate(e for e in expressions() if not e.startswith("label_values")):
        expr = expr.replace("$__rate_interval", "5m").replace("$model", ".*")
        rules.append({"record": f"kvcache:dashboard_expr_{i}", "expr": expr})
    path = tmp_path / "rules.json"  # promtool reads YAML; JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
