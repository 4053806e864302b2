"""The tier's keys: the SGLang backend's names, unknown ones and bad values refused."""

from __future__ import annotations

import pytest

from kvcache.errors import ConfigError
from kvcache.integrations.sglang.config import StorageConfig
from kvcache.integrations.vllm.tier.config import TierConfig


def test_defaults_and_shared_names_with_sglang() -> None:
    cfg = TierConfig.from_extra({"endpoint": "tcp://h:5555", "cache_salt": "team-a", "model_name": "m"})
    assert (cfg.endpoint, cfg.cache_salt, cfg.model_name) == ("tcp://h:5555", "team-a", "m")
    shared = {"endpoint", "cache_salt", "model_name", "timeout_s", "daemon_uid", "curve_server_key",
              "curve_secret_key"}  # fmt: skip
    assert shared <= set(TierConfig.__dataclass_fields__) & set(StorageConfig.__dataclass_fields__)
    assert TierConfig.from_extra(None) == TierConfig()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cache_sallt": "a"}, "unknown KVCacheTier keys"),
        ({"staging_chunks": 0}, "staging_chunks"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"lookup_timeout_s": -1}, "lookup_timeout_s"),
        ({"max_pending_stores": 0}, "max_pending_stores"),
        ({"locality": "local"}, "locality"),
        ({"enable_kv_events": "true"}, "enable_kv_events"),
        ({"cache_salt": 3}, "cache_salt"),
    ],
)
def test_bad_keys_are_refused(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TierConfig.from_extra(extra)
