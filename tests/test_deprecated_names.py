"""The names issue 21's glossary replaced still work for one release, and each use says so.

Each old name must resolve to the very object of its new name (code written against it keeps
working, ``isinstance`` included) and must raise a ``DeprecationWarning`` that names the
replacement, pointing at the caller's line. Unknown names still fail as before.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

RENAMED = [
    ("kvcache", "GPUCacheContext", "CacheContext"),
    ("kvcache", "GPUKVFormat", "KVFormat"),
    ("kvcache.context", "GPUCacheContext", "CacheContext"),
    ("kvcache.layouts", "GPUKVFormat", "KVFormat"),
    ("kvcache", "KVShape", "Geometry"),
    ("kvcache.layouts", "KVShape", "Geometry"),
    ("kvcache.transfer", "ChunkGeometry", "Geometry"),
    ("kvcache.transfer.validate", "ChunkGeometry", "Geometry"),
    ("kvcache.storage", "SlotGeometry", "SlotShape"),
    ("kvcache.storage.l1.pool", "SlotGeometry", "SlotShape"),
    ("kvcache.storage.l1.slab", "SlotGeometry", "SlotShape"),
    ("kvcache.observability", "NullEventSink", "NullEventBus"),
    ("kvcache.observability", "DisabledEventBus", "NullEventBus"),
    ("kvcache.observability.event", "NullEventSink", "NullEventBus"),
    ("kvcache.observability.bus", "DisabledEventBus", "NullEventBus"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED)
def test_old_name_warns_and_is_the_new_object(module: str, old: str, new: str) -> None:
    mod = importlib.import_module(module)
    pattern = rf"{module}\.{old} is deprecated.*use {module}\.{new}"
    with pytest.warns(DeprecationWarning, match=pattern) as rec:
        value = getattr(mod, old)
    assert value is getattr(mod, new)
    assert rec[0].filename == __file__  # the warning points at the caller, not at kvcache


@pytest.mark.parametrize("module", sorted({m for m, _, _ in RENAMED}))
def test_new_names_do_not_warn_and_unknown_names_still_fail(module: str) -> None:
    mod = importlib.import_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _, _, new in (r for r in RENAMED if r[0] == module):
            getattr(mod, new)
        with pytest.raises(AttributeError, match="NoSuchName"):
            getattr(mod, "NoSuchName")  # noqa: B009


def test_from_import_of_an_old_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="GPUCacheContext"):
        from kvcache import GPUCacheContext  # noqa: F401


def test_offload_stats_load_is_retrieve_and_warns() -> None:
    from kvcache.engine.stats import OffloadStats, OffloadStatsCollector

    c = OffloadStatsCollector()
    c.record_retrieve(100, 0.5, 10)
    stats = c.snapshot()
    with pytest.warns(DeprecationWarning, match=r"OffloadStats\.load is deprecated.*OffloadStats\.retrieve"):
        assert stats.load is stats.retrieve
    with pytest.warns(DeprecationWarning, match="avg_retrieve_seconds_per_token"):
        assert stats.avg_load_seconds_per_token == stats.avg_retrieve_seconds_per_token == 0.05
    # A dict written before the rename ("load") reads back as the same stats.
    old = stats.to_dict()
    old["load"] = old.pop("retrieve")
    assert OffloadStats.from_dict(old) == OffloadStats.from_dict(stats.to_dict()) == stats


def test_kvcache_itself_uses_no_old_name() -> None:
    """Only the alias tables (and prose, in double backquotes) name an old name: kvcache's
    own code (whose imports run in every test) would otherwise warn, and keep the old word."""
    root = Path(__file__).resolve().parent.parent / "kvcache"
    old = {o for _, o, _ in RENAMED}
    names = "|".join(sorted(old))
    pattern = re.compile(rf"(?<!``)\b({names})\b(?!``)")
    alias = re.compile(rf'"({names})"|^\s*({names}) = ')
    uses = [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not alias.search(line)
    ]
    assert not uses, "\n".join(uses)
