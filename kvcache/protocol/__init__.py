"""The daemon protocol: msgspec Structs on MessagePack frames (``messages``), their codec, and
the mapping between wire error codes and kvcache exceptions (``errors``)."""

from kvcache.protocol.messages import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
