"""The wire vocabulary: tags are stable, and nothing on the daemon's path can unpickle."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

import kvcache
from kvcache.protocol import messages as m
from kvcache.protocol.codec import DecodeFailure, decode_request, encode_request, pack_ids
from kvcache.records import MAX_NAME


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


@pytest.mark.parametrize(
    "body",
    [
        m.Lookup(instance_id=1, token_ids=pack_ids([1]), request_id="r" * (MAX_NAME + 1)),
        m.Lookup(instance_id=1, token_ids=pack_ids([1]), cache_salt="s" * (MAX_NAME + 1)),
        m.EndSession(instance_id=1, request_id="r" * (MAX_NAME + 1)),
        m.ReportBlockAllocations(
            instance_id=1, records=[m.BlockAllocationRecord("r" * (MAX_NAME + 1), [], [])]
        ),
        m.ReportBlockAllocations(
            instance_id=1, records=[m.BlockAllocationRecord("r", [], [])] * (m.MAX_REPORT_RECORDS + 1)
        ),
    ],
    ids=["request_id", "cache_salt", "end_session", "record_req_id", "records"],
)
def test_names_and_lists_the_daemon_would_keep_or_decode_at_length_are_bounded(body: m.RequestBody) -> None:
    """A request id or salt the daemon keeps (lifecycle state, hashers) may not be megabytes
    long, and a list of structs the I/O thread decodes item by item may not be millions long:
    the decoder refuses them (``BAD_MESSAGE``) before any handler runs; at the bound they pass."""
    with pytest.raises(DecodeFailure) as failure:
        decode_request(encode_request(3, body))
    assert failure.value.error.code is m.ErrorCode.BAD_MESSAGE
    assert failure.value.request_id == 3
    at_bound = m.Lookup(instance_id=1, token_ids=pack_ids([1]), request_id="r" * MAX_NAME)
    assert decode_request(encode_request(4, at_bound)).body == at_bound
