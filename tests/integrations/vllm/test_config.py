"""kv_connector_extra_config parsing: both connector halves must derive the same identity."""

from __future__ import annotations

import pytest

from kvcache.integrations.vllm.config import ConnectorConfig, TPGroup
from kvcache.protocol.messages import MAX_LOOKUP_BATCH


def test_defaults_and_unknown_keys() -> None:
    cfg = ConnectorConfig.from_extra(None)
    assert cfg.endpoint is None and cfg.load and cfg.store and cfg.shared_memory  # None: ipc default
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.from_extra({"endpiont": "x"})
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra({"timeout_s": 0})
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra({"instance_id": -1})


def test_instance_id_is_stable_per_engine_and_distinct_per_rank() -> None:
    cfg = ConnectorConfig.from_extra({})
    a0, a1 = cfg.resolve_instance_id("engine-a", 0), cfg.resolve_instance_id("engine-a", 1)
    assert a0 == ConnectorConfig.from_extra({}).resolve_instance_id("engine-a", 0)
    assert a1 == a0 + 1 and cfg.resolve_instance_id("engine-b") != a0
    assert ConnectorConfig.from_extra({"instance_id": 7}).resolve_instance_id("x", 2) == 9


def test_model_name_scoped_per_rank_under_tensor_parallelism() -> None:
    cfg = ConnectorConfig.from_extra({"model_name": "m"})
    assert cfg.resolve_model_name("served") == "m"
    assert ConnectorConfig.from_extra({}).resolve_model_name("served", 1, 2) == "served@tp1of2"


def test_replicated_ranks_share_one_scope_and_one_writer() -> None:
    """MLA at TP=N (``kv_tp_replicas`` = N): one scope, the first rank writes; no two TP sizes,
    and no replicated and per-rank layout, share a scope."""
    mla = [TPGroup(r, 2, 2) for r in range(2)]
    assert {g.model_name("m") for g in mla} == {"m@tp0of1x2"}
    assert [g.writes for g in mla] == [True, False]
    assert TPGroup(3, 4, 2).model_name("m") == "m@tp1of2x2" and not TPGroup(3, 4, 2).writes
    names = {TPGroup(0, n, r).model_name("m") for n, r in [(1, 1), (2, 1), (2, 2), (4, 4), (4, 2), (8, 8)]}
    assert len(names) == 6
    per_rank = [TPGroup(r, 2) for r in range(2)]  # heads sharded: the scopes of every release
    assert [g.model_name("m") for g in per_rank] == ["m@tp0of2", "m@tp1of2"] and all(
        g.writes for g in per_rank
    )
    assert ConnectorConfig.from_extra({}).resolve_model_name("served", 1, 4, 4) == "served@tp0of1x4"


def test_a_replica_count_that_does_not_divide_the_world_is_per_rank() -> None:
    for bad in (0, 3, -1):
        group = TPGroup(1, 4, bad)
        assert group.replicas == 1 and group.writes and group.model_name("m") == "m@tp1of4"


def test_transfers_are_asynchronous_by_default() -> None:
    cfg = ConnectorConfig.from_extra({})
    assert cfg.async_loads and cfg.async_stores
    assert not ConnectorConfig.from_extra({"async_loads": False}).async_loads


def test_lookup_batch_is_bounded_by_what_one_message_carries() -> None:
    assert ConnectorConfig.from_extra({}).lookup_batch == 32
    assert ConnectorConfig.from_extra({"lookup_batch": 1}).lookup_batch == 1  # one per request
    for bad in (0, MAX_LOOKUP_BATCH + 1):
        with pytest.raises(ValueError, match="lookup_batch"):
            ConnectorConfig.from_extra({"lookup_batch": bad})


def test_switches_take_only_booleans() -> None:
    """``"false"`` as a string would be truthy: it switches nothing on, it is refused."""
    for key in ("shared_loads", "async_loads", "sync_lone_loads", "store"):
        with pytest.raises(ValueError, match="switches take true or false"):
            ConnectorConfig.from_extra({key: "false"})
        assert getattr(ConnectorConfig.from_extra({key: False}), key) is False
