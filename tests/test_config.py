"""EngineConfig: defaults, validation on construction, immutability."""

from __future__ import annotations

import dataclasses

import pytest

from kvcache.config import ConfigError, EngineConfig
from kvcache.errors import KvcacheError


def test_defaults() -> None:
    cfg = EngineConfig()
    assert cfg.chunk_size == 256
    assert cfg.l2_disk_path is None and cfg.l2_redis_url is None
    assert 0 < cfg.l1_evict_watermark <= 1
    assert cfg.to_dict()["chunk_size"] == 256


@pytest.mark.parametrize(
    "field,value",
    [
        ("chunk_size", 0),
        ("chunk_size", -256),
        ("chunk_size", 25.6),
        ("chunk_size", True),
        ("l1_size_bytes", 0),
        ("l1_extent_bytes", -1),
        ("l1_evict_watermark", 0.0),
        ("l1_evict_watermark", 1.5),
        ("l1_evict_watermark", float("nan")),
        ("l2_disk_size_bytes", 0),
        ("l2_max_inflight", 0),
        ("l2_workers", 0),
        ("l2_redis_socket_timeout_s", 0),
        ("l2_redis_connect_timeout_s", float("inf")),
        ("l2_retry_interval_s", -1.0),
        ("retrieve_wait_timeout_s", 0),
        ("l2_redis_ttl_s", 0),
        ("l2_disk_path", ""),
        ("l2_redis_url", "http://localhost:6379"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and isinstance(info.value, KvcacheError)


def test_good_values() -> None:
    cfg = EngineConfig(
        chunk_size=64,
        l1_evict_watermark=1,
        l2_disk_path="/tmp/x",
        l2_redis_url="redis://127.0.0.1:1/0",
        l2_redis_ttl_s=60,
    )
    assert cfg.l2_redis_ttl_s == 60


def test_frozen_and_replace_validates() -> None:
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 1  # type: ignore[misc]
    assert cfg.replace(chunk_size=512).chunk_size == 512
    with pytest.raises(ConfigError):
        cfg.replace(chunk_size=0)
    assert EngineConfig() == EngineConfig()
