"""The wire vocabulary: tags are stable, and nothing on the daemon's path can unpickle."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec

import kvcache
from kvcache.protocol import messages as m


def test_every_request_and_reply_has_a_distinct_stable_tag() -> None:
    requests = {c.__struct_config__.tag for c in m.RequestBody.__args__}
    replies = {c.__struct_config__.tag for c in m.ReplyBody.__args__}
    assert requests == {"register", "unregister", "lookup", "store", "retrieve",
                        "report_block_allocations", "end_session", "status", "ping",
                        "page_exists", "page_set", "page_get", "lookup_batch"}  # fmt: skip
    assert replies == {"error", "registered", "done", "lookup", "store", "retrieve", "status", "pong",
                       "page_exists", "lookup_batch"}  # fmt: skip


def test_defaults_stay_off_the_wire() -> None:
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(m.Ping()))
    assert raw == {"op": "ping"}


def test_no_module_on_the_daemon_path_imports_pickle() -> None:
    root = Path(kvcache.__file__).parent
    packages = ("protocol", "transport", "server", "client")
    files = [path for package in packages for path in root.glob(f"{package}/*.py")]
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            banned = {"pickle", "cPickle", "dill", "cloudpickle"}
            assert not any(n.split(".")[0] in banned for n in names), path
