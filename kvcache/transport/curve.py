"""CURVE keys as both ends read them: certificate files from ``kvcache keys``, or a public key
given inline.

Shared by the daemon (its own secret key), the KV-event publisher (the same) and the client
(the daemon's public key and its own key pair), so a key file means the same thing to each.
"""

from __future__ import annotations

import os

import zmq
import zmq.auth


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``*.key_secret`` certificate (``kvcache keys``)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key {path}: {exc}") from None
    if secret is None:
        raise ValueError(f"{path} holds only a public key; pass the .key_secret file")
    return public, secret


def load_public_key(value: str) -> bytes:
    """A Z85 public key given inline (40 characters) or as a certificate file path."""
    if len(value) == 40 and not os.path.exists(value):
        return value.encode()
    try:
        public, _ = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE public key {value}: {exc}") from None
    return public


def curve_sockopts(server_public_key: str, secret_key_file: str) -> dict[int, int | bytes]:
    """DEALER options for a CURVE daemon: its public key (Z85 or a .key file) and this
    client's key pair (a .key_secret file from ``kvcache keys``)."""
    public, secret = load_secret_key(secret_key_file)
    return {
        zmq.CURVE_SERVERKEY: load_public_key(server_public_key),
        zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: secret,
    }


__all__ = ["curve_sockopts", "load_public_key", "load_secret_key"]
