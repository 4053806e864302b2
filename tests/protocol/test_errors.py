"""Wire error codes and exceptions translate both ways, most specific class first."""

from __future__ import annotations

import pytest

import kvcache.errors
from kvcache.errors import (
    BlockIdError,
    ConfigError,
    CorruptChunkError,
    CudaError,
    CudaUnavailableError,
    DaemonStartError,
    KvcacheError,
    LayoutError,
    ProtocolError,
    RedisURLError,
    StorageError,
    UnknownInstanceError,
)
from kvcache.protocol.errors import (
    GENERIC_CODES,
    DaemonUnavailableError,
    RemoteError,
    ShuttingDownError,
    error_from_exception,
    exception_from_error,
)
from kvcache.protocol.messages import Error, ErrorCode


@pytest.mark.parametrize(
    ("exc", "code", "cls"),
    [
        (UnknownInstanceError("instance 3"), ErrorCode.UNKNOWN_INSTANCE, UnknownInstanceError),
        (BlockIdError("block 99"), ErrorCode.BLOCK_ID, BlockIdError),
        (LayoutError("bad"), ErrorCode.LAYOUT, LayoutError),
        (CorruptChunkError("crc"), ErrorCode.STORAGE, StorageError),
        (ProtocolError("x"), ErrorCode.BAD_MESSAGE, ProtocolError),
        (ValueError("neg"), ErrorCode.BAD_REQUEST, RemoteError),
        (CudaError("device fault"), ErrorCode.CUDA, CudaError),
        (CudaUnavailableError("no GPU"), ErrorCode.CUDA_UNAVAILABLE, CudaUnavailableError),
    ],
)
def test_round_trip_keeps_the_class_and_message(
    exc: Exception, code: ErrorCode, cls: type[Exception]
) -> None:
    error = error_from_exception(exc)
    assert error.code is code
    back = exception_from_error(error)
    assert isinstance(back, cls)
    assert str(exc) in str(back)


def test_unexpected_exception_is_internal_without_traceback() -> None:
    error = error_from_exception(ZeroDivisionError("division by zero"))
    assert error.code is ErrorCode.INTERNAL
    assert error.message == "ZeroDivisionError: division by zero"
    assert "Traceback" not in error.message
    back = exception_from_error(error)
    assert isinstance(back, RemoteError) and back.code is ErrorCode.INTERNAL


def test_shutting_down_is_a_daemon_unavailable_timeout() -> None:
    back = exception_from_error(Error(code=ErrorCode.SHUTTING_DOWN, message="stopping"))
    assert isinstance(back, ShuttingDownError)
    assert isinstance(back, DaemonUnavailableError) and isinstance(back, TimeoutError)


def test_every_code_maps_to_an_exception() -> None:
    for code in ErrorCode:
        assert isinstance(exception_from_error(Error(code=code, message="m")), Exception)


def _errors_in_the_tree() -> list[type[KvcacheError]]:
    return [
        cls
        for cls in vars(kvcache.errors).values()
        if isinstance(cls, type) and issubclass(cls, KvcacheError)
    ]


@pytest.mark.parametrize("cls", _errors_in_the_tree(), ids=lambda cls: cls.__name__)
def test_each_error_answers_with_its_class_code_and_comes_back_as_itself(
    cls: type[KvcacheError],
) -> None:
    exc = cls(ErrorCode.STORAGE, "m") if cls is RemoteError else cls("m")
    error = error_from_exception(exc)
    assert error.code is cls.wire_code
    back = exception_from_error(error)
    if "wire_code" in cls.__dict__ and cls.wire_code not in GENERIC_CODES:
        assert type(back) is cls
    else:  # a code inherited or shared: the client raises the class that names it
        assert isinstance(back, KvcacheError)


def test_every_error_lives_in_the_one_tree() -> None:
    assert DaemonStartError in _errors_in_the_tree()
    assert issubclass(DaemonStartError, RuntimeError)
    assert issubclass(ConfigError, ValueError) and issubclass(RedisURLError, ConfigError)


@pytest.mark.parametrize("exc_type", [TypeError, RuntimeError, kvcache.errors.LayoutError])
def test_a_native_backtrace_never_reaches_the_client(exc_type: type[Exception]) -> None:
    """torch appends its C++ backtrace, with addresses in the daemon's own mappings, to some
    errors: the reply keeps the sentence for people and drops the rest (and stays short)."""
    text = (
        "as_strided(): argument 'stride' failed to unpack the object at pos 1\n"
        "Exception raised from unpack at ../torch/csrc/utils/python_arg_parser.cpp:1"
        " (most recent call first):\n"
        "frame #0: c10::Error::Error(...) + 0x9b (0x7fa95cb79b8d in /usr/lib/libc10.so)\n"
    )
    err = error_from_exception(exc_type(text))
    assert err.message.endswith("failed to unpack the object at pos 1"), err.message
    assert "frame #" not in err.message and "0x7f" not in err.message
    assert len(error_from_exception(ValueError("x" * 10_000)).message) <= 2000
