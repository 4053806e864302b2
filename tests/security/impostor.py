"""A fake kvcache daemon, as another local user would run one to catch engines' memory.

Run as ``python -m tests.security.impostor DIR [--uid N] [--zmq] [--tcp] [--fds]``. It listens
where a real daemon would (``DIR/daemon.sock`` and, with ``--tcp``, a loopback port; with
``--fds``, ``DIR/fds.sock``), answers every request with a ``Pong`` naming ``DIR/fds.sock``,
and accepts every memfd hand-over. With ``--uid`` it drops to that uid (and its gid) after its
imports and before it listens, so ``SO_PEERCRED`` names that user: the tests run as root and
need no second login, and the Python install need not be readable by that user.

It prints ``ready ENDPOINT`` once listening, then one line per thing it caught (``request
Register``, ``fds 2``; ``connected`` for a client that connected and left without sending),
and exits when its stdin closes: the test reads the whole catch after
the client gave up, so nothing depends on timing.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import sys
from typing import Any

import msgspec
import zmq

from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_request, encode_reply
from kvcache.transport.fdproto import FdReply


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--uid", type=int)
    parser.add_argument("--zmq", action="store_true", help="listen on DIR/daemon.sock")
    parser.add_argument("--tcp", action="store_true", help="listen on a loopback port")
    parser.add_argument("--fds", action="store_true", help="listen on DIR/fds.sock")
    args = parser.parse_args()
    if args.uid is not None:
        os.setgroups([])
        os.setgid(args.uid)
        os.setuid(args.uid)
    fd_path = os.path.join(args.dir, "fds.sock")
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = "-"
    if args.zmq:
        router.bind(f"ipc://{os.path.join(args.dir, 'daemon.sock')}")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    if args.tcp:
        router.bind("tcp://127.0.0.1:0")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    listener = None
    if args.fds:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(fd_path)
        listener.listen(8)
    print("ready", endpoint, flush=True)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    if listener is not None:
        poller.register(listener, zmq.POLLIN)
    try:
        _serve(poller, router, listener, fd_path)
    finally:
        router.close(linger=0)
        ctx.term()


def _serve(poller: zmq.Poller, router: zmq.Socket[Any], listener: socket.socket | None, fd_path: str) -> None:
    while True:
        ready = dict(poller.poll())
        if sys.stdin.fileno() in ready and not sys.stdin.readline():
            return  # the test is done: stdin closed
        if router in ready:
            ident, frame = router.recv_multipart()
            envelope = decode_request(frame)
            print("request", type(envelope.body).__name__, flush=True)
            pong = m.Pong(protocol_version=m.PROTOCOL_VERSION, fd_socket=fd_path)
            router.send_multipart([ident, encode_reply(envelope.id, pong)])
        if listener is not None and listener.fileno() in ready:
            conn, _ = listener.accept()
            with conn:
                select.select([conn], [], [], 5)
                msg, fds, _, _ = socket.recv_fds(conn, 64, 64)
                if not msg and not fds:  # connected, looked at us, left: nothing caught
                    print("connected", flush=True)
                    continue
                print("fds", len(fds), flush=True)
                conn.send(msgspec.msgpack.encode(FdReply()))


if __name__ == "__main__":
    main()
