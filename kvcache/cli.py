"""The ``kvcache`` console script: ``kvcache server``, ``bench``, ``demo`` and ``keys``.

A thin dispatcher so that each subcommand keeps its own module (and its own imports: the
benchmark entry point must not pull in the daemon, nor the daemon the benchmarks).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "server": ("kvcache.server.__main__", "run the kvcache daemon (same as python -m kvcache.server)"),
    "bench": ("kvcache.bench.__main__", "run a benchmark (same as python -m kvcache.bench)"),
    "demo": ("kvcache.demo", "start a daemon and a demo engine; store, look up, retrieve"),
    "keys": ("kvcache.server.keygen", "create a CURVE key pair for the daemon or a client"),
}


def _usage() -> str:
    lines = ["usage: kvcache {" + ",".join(COMMANDS) + "} [options]", ""]
    lines += [f"  {name:<7} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "kvcache COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"kvcache: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    name, rest = args[0], args[1:]
    module = importlib.import_module(COMMANDS[name][0])
    if name == "server":
        return int(module.main(rest, prog="kvcache server"))
    entry: Callable[[list[str]], int] = module.main
    return int(entry(rest))


if __name__ == "__main__":
    sys.exit(main())
