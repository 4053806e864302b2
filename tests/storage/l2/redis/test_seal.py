"""Sealed Redis records (``seal``): the key file's checks, the daemon's refusal to start with
an unstated trust, and records moved or altered in a real ``redis-server`` by someone who can
write to it but lacks the key (the daemon-level attack is tests/security/test_shared_redis.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_py
import torch

from kvcache.errors import ConfigError, ForgedRecordError, UntrustedPathError
from kvcache.server.settings import parse_settings
from kvcache.storage.l2 import codec
from kvcache.storage.l2.base import failure_reason
from kvcache.storage.l2.redis.seal import SEALED_PREFIX, RecordSeal
from kvcache.storage.l2.redis.single import RedisL2Adapter, chunk_name
from kvcache.testing.redis_local import LocalRedis

K1, K2 = 0x11 << 100, 0x22 << 100
SECRET = "s" * 64


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    with LocalRedis() as s:
        yield s


def _key_file(tmp_path: Path, text: str = SECRET, mode: int = 0o600) -> str:
    path = tmp_path / "l2.key"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def _tier(server: LocalRedis, seal: RecordSeal | None, prefix: str) -> RedisL2Adapter:
    return RedisL2Adapter(server.url, key_prefix=prefix, seal=seal)


# -- the key file ------------------------------------------------------------------------


def test_a_private_key_file_gives_a_seal(tmp_path: Path) -> None:
    a = RecordSeal.from_file(_key_file(tmp_path))
    assert a.tag(b"n", [b"x"]) == RecordSeal(SECRET.encode()).tag(b"n", [b"x"])


@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_a_key_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(UntrustedPathError, match="open to other users"):
        RecordSeal.from_file(_key_file(tmp_path, mode=mode))


def test_a_symlinked_key_file_is_refused(tmp_path: Path) -> None:
    real = _key_file(tmp_path)
    os.symlink(real, tmp_path / "link.key")
    with pytest.raises(UntrustedPathError, match="symlink"):
        RecordSeal.from_file(str(tmp_path / "link.key"))


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(UntrustedPathError, match="owned by uid 65534"):
        RecordSeal.from_file(path)


def test_a_short_or_missing_key_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 32"):
        RecordSeal.from_file(_key_file(tmp_path, "short\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        RecordSeal.from_file(str(tmp_path / "nope.key"))


# -- the daemon's flags ------------------------------------------------------------------


def test_a_redis_tier_without_a_stated_trust_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--l2-redis-url", "redis://127.0.0.1:1/0"])
    assert "--l2-redis-auth-key-file" in capsys.readouterr().err


def test_the_key_file_is_checked_before_the_daemon_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _key_file(tmp_path, mode=0o644)
    with pytest.raises(SystemExit):
        parse_settings(["--l2-redis-url", "redis://127.0.0.1:1/0", "--l2-redis-auth-key-file", bad])
    assert "open to other users" in capsys.readouterr().err
    os.chmod(bad, 0o600)
    s = parse_settings(["--l2-redis-url", "redis://127.0.0.1:1/0", "--l2-redis-auth-key-file", bad])
    assert s.engine.l2_redis_auth_key_file == bad


@pytest.mark.parametrize(
    "argv",
    [
        ["--l2-redis-trust-all"],
        ["--l2-redis-url", "redis://127.0.0.1:1/0", "--l2-redis-trust-all", "--l2-redis-auth-key-file", "f"],
    ],
)
def test_contradicting_trust_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(argv)


# -- records in a real Redis -------------------------------------------------------------


def test_sealed_records_round_trip_and_a_trusting_tier_reads_them(server: LocalRedis) -> None:
    seal = RecordSeal(SECRET.encode())
    chunk = torch.arange(64, dtype=torch.float16)
    sealed = _tier(server, seal, "rt:")
    sealed.store(K1, chunk)
    out = torch.empty_like(chunk)
    assert sealed.load(K1, out) and torch.equal(out, chunk)
    out.zero_()
    assert _tier(server, None, "rt:").load(K1, out) and torch.equal(out, chunk)  # trust-all: reads it


def test_a_sealed_record_moved_under_another_key_is_forged(server: LocalRedis) -> None:
    """A replay: the attacker copies a record the fleet sealed to the name of another chunk
    of the same shape, and rewrites the key in its header so the header checks pass."""
    seal = RecordSeal(SECRET.encode())
    chunk = torch.arange(64, dtype=torch.float16)
    tier = _tier(server, seal, "mv:")
    tier.store(K1, chunk)
    raw = redis_py.Redis.from_url(server.url)
    value = bytearray(raw.get(chunk_name("mv:", K1)) or b"")
    value[SEALED_PREFIX + 8 : SEALED_PREFIX + 24] = K2.to_bytes(16, "little")  # header key
    header = codec.decode_header(bytes(value[SEALED_PREFIX:]))
    assert header.key == K2  # the record itself now claims to be K2
    raw.set(chunk_name("mv:", K2), bytes(value))
    with pytest.raises(ForgedRecordError) as info:
        tier.load(K2, torch.empty_like(chunk))
    assert failure_reason(info.value) == "forged"
    assert raw.exists(chunk_name("mv:", K2)) == 0  # dropped, as a corrupt record is
    raw.close()


def test_a_payload_altered_with_a_fixed_crc_is_forged(server: LocalRedis) -> None:
    seal = RecordSeal(SECRET.encode())
    chunk = torch.arange(64, dtype=torch.float16)
    tier = _tier(server, seal, "alt:")
    tier.store(K1, chunk)
    raw = redis_py.Redis.from_url(server.url)
    name = chunk_name("alt:", K1)
    value = bytes(raw.get(name) or b"")
    evil = torch.full_like(chunk, 7)
    payload = codec.tensor_bytes(evil)
    record = codec.encode_header(K1, evil, payload) + payload.tobytes()  # a valid CRC
    raw.set(name, value[:SEALED_PREFIX] + record)  # the old tag, the new record
    out = torch.empty_like(chunk)
    with pytest.raises(ForgedRecordError):
        tier.load(K1, out)
    assert not torch.equal(out, evil)
    raw.close()


def test_a_record_sealed_with_another_key_is_forged(server: LocalRedis) -> None:
    chunk = torch.arange(64, dtype=torch.float16)
    _tier(server, RecordSeal(b"x" * 32), "other:").store(K1, chunk)
    with pytest.raises(ForgedRecordError):
        _tier(server, RecordSeal(SECRET.encode()), "other:").load(K1, torch.empty_like(chunk))
