"""``kvcache keys NAME``: make a CURVE key pair for the daemon or for one client.

Kept apart from the daemon so an operator can make keys on a machine that never runs one.
The files are pyzmq's certificate format (``zmq.auth.create_certificates``): ``NAME.key``
holds the public key and may be shared; ``NAME.key_secret`` holds both and stays with its
owner (created 0600). For a client, the command prints the ``[[client]]`` entry to add to
the daemon's ``--clients`` allow-list.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import zmq.auth


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvcache keys",
        description="Create a CURVE key pair (NAME.key public, NAME.key_secret private).",
    )
    parser.add_argument("name", help="who the keys are for: 'daemon', or a client/tenant name")
    parser.add_argument("--dir", default=".", help="where to write the two files (default: .)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    ns = parser.parse_args(argv)
    if not ns.name or os.sep in ns.name or ns.name.startswith("."):
        parser.error(f"NAME must be a plain file name, got {ns.name!r}")
    public_file = os.path.join(ns.dir, f"{ns.name}.key")
    secret_file = os.path.join(ns.dir, f"{ns.name}.key_secret")
    existing = [p for p in (public_file, secret_file) if os.path.exists(p)]
    if existing and not ns.force:
        print(f"kvcache keys: {', '.join(existing)} exists; pass --force to replace", file=sys.stderr)
        return 1
    os.makedirs(ns.dir, exist_ok=True)
    old = os.umask(0o077)  # the secret file must never be readable by others, not even briefly
    try:
        for path in existing:
            os.unlink(path)
        zmq.auth.create_certificates(ns.dir, ns.name)
    finally:
        os.umask(old)
    os.chmod(public_file, 0o644)
    public, _ = zmq.auth.load_certificate(public_file)
    print(f"wrote {public_file} (public) and {secret_file} (secret, 0600)")
    print("\n# for the daemon's --clients file:")
    print(f'[[client]]\nname = "{ns.name}"\npublic_key = "{public.decode()}"')
    print('# models = ["my-model"]      # optional restriction')
    print('# cache_salts = [""]         # optional restriction')
    print("# kv_events = true           # a router: may read every tenant's KV events")
    print("# models = []                # with it: a reader only, registers no engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
