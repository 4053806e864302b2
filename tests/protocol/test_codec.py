"""The codec: round trips, and every kind of bad frame becomes a typed error, never a crash."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.observability.event import BlockAllocationRecord
from kvcache.protocol import messages as m
from kvcache.protocol.codec import (
    DecodeFailure,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    pack_ids,
    unpack_ids,
)

SAMPLE_REQUESTS: list[m.RequestBody] = [
    m.Register(
        instance_id=3,
        model_name="llama",
        tensors=[
            m.FdTensor(fd_index=0, offset=64, shape=[2, 4], stride=[4, 1], dtype="float16"),
            m.CudaIpcTensor(
                device_uuid="GPU-1",
                ipc_handle=b"\x00\x01",
                storage_size_bytes=10,
                storage_offset_bytes=0,
                event_handle=b"",
                event_sync_required=False,
                storage_offset=0,
                shape=[1],
                stride=[1],
                dtype="bfloat16",
            ),
        ],
        nesting="nested",
        group_sizes=[1, 1],
        fmt="NL_X_TWO_NB_BS_NH_HS",
        block_size=16,
    ),
    m.Unregister(instance_id=1),
    m.Lookup(instance_id=1, token_ids=pack_ids([1, 2, 3]), cache_salt="s"),
    m.Store(
        instance_id=1, token_ids=pack_ids([5] * 32), block_ids=pack_ids([0, 1]), block_hashes=[-1, 2**63 - 1]
    ),
    m.Retrieve(instance_id=1, token_ids=pack_ids([-5] * 32), block_ids=pack_ids([0, 1]), skip_tokens=16),
    m.ReportBlockAllocations(instance_id=2, records=[BlockAllocationRecord("r1", [1, 2], [7, 8, 9])]),
    m.EndSession(instance_id=2, request_id="r1"),
    m.Status(),
    m.Ping(instance_id=4),
    m.Ping(),
    m.LookupBatch(
        instance_id=3,
        items=[
            m.LookupItem(token_ids=pack_ids([1, 2]), cache_salt="s", request_id="r1", key_extra="lora"),
            m.LookupItem(token_ids=pack_ids([-1])),
        ],
        token=b"t",
    ),
]


@pytest.mark.parametrize("body", SAMPLE_REQUESTS, ids=lambda b: type(b).__name__)
def test_every_request_round_trips(body: m.RequestBody) -> None:
    envelope = decode_request(encode_request(42, body))
    assert envelope.id == 42 and envelope.v == m.PROTOCOL_VERSION
    assert envelope.body == body


SAMPLE_REPLIES: list[m.ReplyBody] = [
    m.Error(code=m.ErrorCode.UNKNOWN_INSTANCE, message="no"),
    m.Registered(
        instance_id=1,
        num_layers=2,
        num_blocks=3,
        block_size=16,
        chunk_size=256,
        fmt="NL_X_NB_BS_HS",
        heartbeat_timeout_s=30.0,
    ),
    m.Done(),
    m.LookupResult(hit_tokens=512),
    m.StoreResult(stored_chunks=1, skipped_chunks=2, failed_chunks=0, stored_tokens=256),
    m.RetrieveResult(retrieved_tokens=256, cuda_event=b"\x01" * 64),
    m.StatusResult(protocol_version=1, pid=1, uptime_s=0.5, instances=[1, 2], engine={"a": [1]}),
    m.Pong(protocol_version=1, registered=True),
    m.LookupBatchResult(hits=[m.LookupHit(512, 256), m.LookupHit(0)]),
]


@pytest.mark.parametrize("body", SAMPLE_REPLIES, ids=lambda b: type(b).__name__)
def test_every_reply_round_trips(body: m.ReplyBody) -> None:
    envelope = decode_reply(encode_reply(7, body))
    assert envelope.id == 7 and envelope.body == body


def test_operations_are_tagged_by_name_on_the_wire() -> None:
    raw = msgspec.msgpack.decode(encode_request(1, m.Lookup(instance_id=1, token_ids=pack_ids([9]))))
    assert raw == {"v": m.PROTOCOL_VERSION, "id": 1,
                   "body": {"op": "lookup", "instance_id": 1, "token_ids": [b"\x09\0\0\0", 4]}}  # fmt: skip


def test_other_version_gets_a_clear_error_with_its_request_id() -> None:
    with pytest.raises(DecodeFailure) as info:
        decode_request(encode_request(9, m.Ping(), version=m.PROTOCOL_VERSION + 1))
    assert info.value.error.code is m.ErrorCode.VERSION_MISMATCH
    assert info.value.request_id == 9
    assert f"v{m.PROTOCOL_VERSION + 1}" in info.value.error.message


def test_other_version_with_an_unknown_body_is_still_a_version_error() -> None:
    frame = msgspec.msgpack.encode({"v": 99, "id": 5, "body": {"op": "teleport", "x": 1}})
    with pytest.raises(DecodeFailure) as info:
        decode_request(frame)
    assert info.value.error.code is m.ErrorCode.VERSION_MISMATCH
    assert info.value.request_id == 5


def test_oversized_frame_is_refused_before_decoding() -> None:
    frame = encode_request(1, m.Lookup(instance_id=1, token_ids=pack_ids(range(5000))))
    with pytest.raises(DecodeFailure) as info:
        decode_request(frame, max_bytes=len(frame) - 1)
    assert info.value.error.code is m.ErrorCode.TOO_LARGE
    body = decode_request(frame, max_bytes=len(frame)).body
    assert isinstance(body, m.Lookup) and unpack_ids(body.token_ids)[-1] == 4999


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01\x02\x03",  # an array, not a map
        msgspec.msgpack.encode({"v": m.PROTOCOL_VERSION, "id": 1, "body": {"op": "nope"}}),
        msgspec.msgpack.encode({"v": m.PROTOCOL_VERSION, "id": 1, "body": {"op": "lookup"}}),
        msgspec.msgpack.encode(
            {
                "v": m.PROTOCOL_VERSION,
                "id": 1,
                "body": {"op": "lookup", "instance_id": -1, "token_ids": [b""]},
            }
        ),
        msgspec.msgpack.encode({"v": "1", "id": 1, "body": {"op": "ping"}}),
        msgspec.msgpack.encode(  # ids of 3 bytes each
            {
                "v": m.PROTOCOL_VERSION,
                "id": 1,
                "body": {"op": "lookup", "instance_id": 1, "token_ids": [b"abc", 3]},
            }
        ),
        msgspec.msgpack.encode(  # the old list-of-ints form
            {
                "v": m.PROTOCOL_VERSION,
                "id": 1,
                "body": {"op": "lookup", "instance_id": 1, "token_ids": [1, 2, 3]},
            }
        ),
        # a pickle is just bytes of the wrong shape here
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94.",
    ],
)
def test_bad_frames_become_bad_message_errors(frame: bytes) -> None:
    with pytest.raises(DecodeFailure) as info:
        decode_request(frame)
    assert info.value.error.code is m.ErrorCode.BAD_MESSAGE
    assert info.value.error.message


def test_truncated_frames_never_decode_silently() -> None:
    frame = encode_request(3, SAMPLE_REQUESTS[0])
    for cut in range(len(frame)):
        with pytest.raises(DecodeFailure):
            decode_request(frame[:cut])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_decode_failure(frame: bytes) -> None:
    try:
        decode_request(frame)
    except DecodeFailure as failure:
        assert isinstance(failure.error, m.Error)
        encode_reply(failure.request_id, failure.error)  # the error reply itself encodes


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    version=st.one_of(st.just(m.PROTOCOL_VERSION), st.integers(-5, 5)),
    op=st.sampled_from(["lookup", "store", "retrieve", "register", "ping", "bogus"]),
    fields=st.dictionaries(
        st.sampled_from(["instance_id", "token_ids", "block_ids", "tensors", "model_name", "x"]),
        _msgpack_values,
        max_size=4,
    ),
    request_id=st.integers(-(2**64), 2**64),
)
def test_fuzz_structured_garbage_is_answered(
    version: int, op: str, fields: dict[str, object], request_id: int
) -> None:
    try:
        frame = msgspec.msgpack.encode({"v": version, "id": request_id, "body": {"op": op, **fields}})
    except OverflowError:
        return
    try:
        envelope = decode_request(frame)
    except DecodeFailure as failure:
        encode_reply(failure.request_id, failure.error)
        return
    assert envelope.v == m.PROTOCOL_VERSION
    assert isinstance(envelope.body, m.Request)


@pytest.mark.parametrize(
    ("ids", "width"),
    [
        ([], 4),
        ([0, 1, 2**32 - 1], 4),
        ([3, -1], 8),
        ([2**32, 7], 8),
        ((5, 6), 4),
        (range(10), 4),
        (np.arange(10, dtype=np.int64), 4),
        (np.array([-2, 9], dtype=np.int32), 8),
        (torch.arange(7), 4),
    ],
)
def test_ids_pack_narrow_when_they_fit_and_round_trip(ids: object, width: int) -> None:
    packed = pack_ids(ids)
    assert packed.width == width
    body = decode_request(encode_request(1, m.Lookup(instance_id=0, token_ids=packed))).body
    assert isinstance(body, m.Lookup)
    back = unpack_ids(body.token_ids)
    assert [int(x) for x in back] == [int(x) for x in ids]  # type: ignore[attr-defined]


def test_bad_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="whole number"):
        unpack_ids(m.IdArray(b"abcde", 4))
    with pytest.raises(TypeError):
        pack_ids(np.array([1.5]))
    with pytest.raises(TypeError):
        pack_ids([1, "2"])
