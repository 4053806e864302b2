"""--l2-redis-url is checked once, with typed errors that never show the password."""

from __future__ import annotations

import re

import pytest

from kvcache.config import ConfigError, EngineConfig
from kvcache.server.settings import parse_settings
from kvcache.storage.l2.redis.url import MAX_SEEDS, RedisURLError, parse_redis_url, redact


def test_single_server_forms() -> None:
    t = parse_redis_url("redis://user:s%40cret@cache.internal:6380/2?health_check_interval=5")
    assert (t.cluster, t.tls, t.nodes, t.username, t.password, t.db) == (
        False, False, (("cache.internal", 6380),), "user", "s@cret", 2,
    )  # fmt: skip
    assert parse_redis_url("rediss://h").nodes == (("h", 6379),) and parse_redis_url("rediss://h").tls
    assert parse_redis_url("redis://[::1]:7000/0").nodes == (("::1", 7000),)
    u = parse_redis_url("unix:///run/redis.sock?db=3")
    assert (u.nodes, u.db, u.cluster) == ((), 3, False)


def test_cluster_forms() -> None:
    t = parse_redis_url("redis+cluster://:pw@10.0.0.1:7000,node-b:7001,[fd00::3]")
    assert t.cluster and not t.tls and t.db == 0 and t.password == "pw" and t.username is None
    assert t.nodes == (("10.0.0.1", 7000), ("node-b", 7001), ("fd00::3", 6379))
    assert parse_redis_url("REDISS+CLUSTER://h:1/").tls  # scheme is case-insensitive
    assert parse_redis_url("redis+cluster://h:1/0").nodes == (("h", 1),)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h:1", "must start with one of"),
        ("redis:/h:1", "must start with one of"),
        ("redis://", "no host"),
        ("redis://h:0", "port must be 1-65535"),
        ("redis://h:65536", "port must be 1-65535"),
        ("redis://h:-1", "port must be 1-65535"),
        ("redis://h:", "empty port"),
        ("redis://h:1/db1", "database must be a number"),
        ("redis://a:1,b:2", "several hosts need redis+cluster://"),
        ("redis://h;rm -rf:1", "whitespace or control"),
        ("redis://h\x00:1", "whitespace or control"),
        ("redis://bad_host!:1", "bad host"),
        ("redis://::1:6379", "brackets"),
        ("redis://[zz::1]:1", "not a URL"),
        ("redis+cluster://[zz::1]:1", "bad IPv6"),
        ("redis://[::1]x:1", "unexpected"),
        ("redis://h:1#frag", "fragment"),
        ("unix://relative.sock", "absolute socket path"),
        ("unix:///s.sock?db=x", "db must be a number"),
        ("redis+cluster://", "needs host:port seeds"),
        ("redis+cluster://a:1,,b:2", "needs host:port seeds"),
        ("redis+cluster://a:1,a:1", "seed node twice"),
        ("redis+cluster://a:1/3", "only database 0"),
        ("redis+cluster://a:1?socket_timeout=9", "no ?options"),
        ("redis+cluster://a:x", "port must be 1-65535"),
        ("redis+cluster://" + ",".join(f"h{i}:1" for i in range(MAX_SEEDS + 1)), "the limit is"),
        ("redis://" + "h" * 5000, "characters long"),
        (12345, "must be a string"),
    ],
)
def test_bad_urls_fail_with_a_typed_error_naming_the_problem(url: object, says: str) -> None:
    with pytest.raises(RedisURLError, match=re.escape(says)) as info:
        parse_redis_url(url)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:hunter2@h:bad/0",  # an error about the port
        "redis+cluster://u:hunter2@a:1,a:1",  # an error about the seeds
        "redis://u:hun/ter2@h:1",  # an unencoded '/' ends the authority early
        "redis+cluster://u:hunter2@",  # no host at all
    ],
)
def test_errors_never_show_the_password(url: str) -> None:
    with pytest.raises(RedisURLError) as info:
        parse_redis_url(url)
    assert "hunter2" not in str(info.value) and "ter2" not in str(info.value)
    assert "hunter2" not in redact(url) and "ter2" not in redact(url)
    assert "hunter2" not in repr(parse_redis_url("redis://u:hunter2@h:1"))


def test_redact() -> None:
    assert redact("redis+cluster://u:pw@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    assert redact("not a url") == "not a url"
    assert parse_redis_url("redis://u:pw@h:1").redacted() == "redis://u:***@h:1"


def test_config_and_flags_validate_at_the_same_boundary(capsys: pytest.CaptureFixture[str]) -> None:
    assert EngineConfig(l2_redis_url="redis+cluster://a:1,b:2").l2_redis_url == "redis+cluster://a:1,b:2"
    with pytest.raises(ConfigError, match="only database 0"):
        EngineConfig(l2_redis_url="redis+cluster://a:1/2")
    with pytest.raises(SystemExit):
        parse_settings(["--l2-redis-url", "redis+cluster://u:topsecret@a:1,a:1"])
    err = capsys.readouterr().err
    assert "seed node twice" in err and "topsecret" not in err
