"""``--l2-redis-url``: parse and validate a Redis / Valkey address once, with typed errors.

The one boundary where an operator's (or an attacker's config file's) URL is checked, so
every later user (the config record, the adapter factory, the log line) holds a
``RedisTarget`` that is known to be well formed and never has to re-parse or guess. A
password never appears in an error message or in ``redacted()``.

Accepted forms::

    redis://[user[:password]@]host[:port][/db][?option=value...]     one server
    rediss://...                                                     one server over TLS
    unix://[user[:password]@]/path/to/redis.sock[?db=N]              one server, local socket
    redis+cluster://[user[:password]@]host[:port][,host[:port]...]   Redis / Valkey Cluster
    rediss+cluster://...                                             cluster over TLS

A cluster URL lists seed nodes (any subset of the cluster; the client learns the rest) and
has no database number (a cluster has only database 0) and no query options: timeouts and
the like come from their own flags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from kvcache.errors import RedisURLError  # re-exported: its public home before kvcache.errors

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
MAX_URL_CHARS = 4096
MAX_SEEDS = 64
# A DNS name (labels of letters, digits, '-', '_', '.') or an IPv4 address; IPv6 goes in [].
_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?$")
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?$")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A validated Redis address.

    ``url`` is the original text (handed to redis-py's own ``from_url`` for a single server,
    so its query options keep working); ``nodes`` are the (host, port) seeds of a cluster, or
    the one server (empty for ``unix://``).
    """

    url: str = field(repr=False)
    scheme: str
    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None = field(repr=False)
    db: int

    def redacted(self) -> str:
        """The URL fit for a log line or ``status()``: the password replaced by ``***``."""
        return redact(self.url)


def redact(url: str) -> str:
    """``url`` with the password of its user-info part (if any) replaced by ``***``.

    Works on any text, well formed or not, so an error about a bad URL can quote it safely.
    """
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if not sep or at < 0 or ":" not in rest[:at]:
        return url
    # The last '@' anywhere, not only in the authority: a password with an unencoded '/'
    # must not leak. Hiding too much of a URL with '@' in its query is the safe mistake.
    user = rest[:at].split(":", 1)[0]
    return f"{scheme}://{user}:***@{rest[at + 1 :]}"


def _netloc_end(rest: str) -> int:
    """Where the authority part of ``rest`` (the URL after ``scheme://``) ends."""
    ends = [i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0]
    return min(ends) if ends else len(rest)


def parse_redis_url(url: object) -> RedisTarget:
    """Validate ``url``; raises ``RedisURLError`` (a ``ConfigError``/``ValueError``)."""
    if not isinstance(url, str):
        raise RedisURLError(f"l2_redis_url must be a string, got {type(url).__name__}")
    if len(url) > MAX_URL_CHARS:
        raise RedisURLError(f"l2_redis_url is {len(url)} characters long; the limit is {MAX_URL_CHARS}")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise RedisURLError(f"l2_redis_url contains whitespace or control characters: {redact(url)!r}")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SINGLE_SCHEMES + CLUSTER_SCHEMES:
        known = ", ".join(f"{s}://" for s in SINGLE_SCHEMES + CLUSTER_SCHEMES)
        raise RedisURLError(f"l2_redis_url must start with one of {known}: {redact(url)!r}")
    if rest.rfind("@") > _netloc_end(rest):
        raise RedisURLError(
            "l2_redis_url: a '/', '?', '#' or '@' in a user name or password must be "
            f"%-encoded (%2F, %3F, %23, %40): {redact(url)!r}"
        )
    if "#" in rest:
        raise RedisURLError(f"l2_redis_url has a '#fragment', which means nothing here: {redact(url)!r}")
    if scheme in CLUSTER_SCHEMES:
        return _parse_cluster(url, scheme, rest)
    return _parse_single(url, scheme)


def _userinfo(url: str, netloc: str) -> tuple[str | None, str | None, str]:
    """Split ``user:password@`` off ``netloc``; the user and password are %-decoded."""
    at = netloc.rfind("@")
    if at < 0:
        return None, None, netloc
    info, hosts = netloc[:at], netloc[at + 1 :]
    user, colon, password = info.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None), hosts


def _host_port(url: str, text: str) -> tuple[str, int]:
    """One ``host[:port]`` / ``[v6]:port`` item, checked."""
    if text.startswith("["):
        end = text.find("]")
        host, tail = text[1:end] if end > 0 else "", text[end + 1 :] if end > 0 else text
        if not host or not _IPV6.match(host) or ":" not in host:
            raise RedisURLError(f"l2_redis_url: bad IPv6 address {text!r} in {redact(url)!r}")
        if tail and not tail.startswith(":"):
            raise RedisURLError(f"l2_redis_url: unexpected {tail!r} after {text[: end + 1]!r}")
        port_text = tail[1:] if tail else ""
    else:
        host, colon, port_text = text.rpartition(":") if ":" in text else (text, "", "")
        if colon and ":" in host:
            raise RedisURLError(f"l2_redis_url: put an IPv6 address in brackets ([::1]:6379): {text!r}")
        if not host or not _HOSTNAME.match(host):
            raise RedisURLError(f"l2_redis_url: bad host {host!r} in {redact(url)!r}")
        if colon and not port_text:
            raise RedisURLError(f"l2_redis_url: empty port after {host!r} in {redact(url)!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RedisURLError(f"l2_redis_url: port must be 1-65535, got {port_text!r} in {redact(url)!r}")
    return host, int(port_text)


def _parse_cluster(url: str, scheme: str, rest: str) -> RedisTarget:
    end = _netloc_end(rest)
    netloc, tail = rest[:end], rest[end:]
    if "?" in tail:
        raise RedisURLError(
            f"l2_redis_url: a cluster URL takes no ?options (timeouts have their own flags): {redact(url)!r}"
        )
    if tail not in ("", "/", "/0"):
        raise RedisURLError(
            f"l2_redis_url: a Redis Cluster has only database 0, got path {tail!r} in {redact(url)!r}"
        )
    user, password, hosts = _userinfo(url, netloc)
    items = hosts.split(",")
    if not hosts or any(not item for item in items):
        raise RedisURLError(
            f"l2_redis_url: a cluster URL needs host:port seeds, comma separated: {redact(url)!r}"
        )
    if len(items) > MAX_SEEDS:
        raise RedisURLError(f"l2_redis_url lists {len(items)} seed nodes; the limit is {MAX_SEEDS}")
    nodes = tuple(_host_port(url, item) for item in items)
    if len(set(nodes)) != len(nodes):
        raise RedisURLError(f"l2_redis_url lists a seed node twice: {redact(url)!r}")
    return RedisTarget(url, scheme, True, scheme.startswith("rediss"), nodes, user, password, 0)


def _parse_single(url: str, scheme: str) -> RedisTarget:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise RedisURLError(f"l2_redis_url is not a URL ({exc}): {redact(url)!r}") from None
    user, password, hosts = _userinfo(url, parts.netloc)
    if scheme == "unix":
        if hosts or not parts.path.startswith("/") or parts.path == "/":
            raise RedisURLError(f"l2_redis_url: unix:// needs an absolute socket path: {redact(url)!r}")
        db = _query_db(url, parts.query)
        return RedisTarget(url, scheme, False, False, (), user, password, db)
    if "," in hosts:
        raise RedisURLError(
            f"l2_redis_url: several hosts need redis+cluster:// (a Redis Cluster): {redact(url)!r}"
        )
    if not hosts:
        raise RedisURLError(f"l2_redis_url: no host in {redact(url)!r}")
    node = _host_port(url, hosts)
    path = parts.path.strip("/")
    if path and not (path.isdigit() and int(path) < 1 << 16):
        raise RedisURLError(f"l2_redis_url: database must be a number, got {path!r} in {redact(url)!r}")
    db = int(path) if path else _query_db(url, parts.query)
    return RedisTarget(url, scheme, False, scheme == "rediss", (node,), user, password, db)


def _query_db(url: str, query: str) -> int:
    for item in query.split("&") if query else ():
        key, _, value = item.partition("=")
        if key == "db":
            if not value.isdigit() or int(value) >= 1 << 16:
                raise RedisURLError(f"l2_redis_url: db must be a number, got {value!r} in {redact(url)!r}")
            return int(value)
    return 0


__all__ = [
    "CLUSTER_SCHEMES",
    "SINGLE_SCHEMES",
    "RedisTarget",
    "RedisURLError",
    "parse_redis_url",
    "redact",
]
