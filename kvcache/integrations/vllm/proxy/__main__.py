"""``python -m kvcache.integrations.vllm.proxy --prefill URL... --decode URL...``

Serves until SIGINT or SIGTERM, then stops taking connections and lets the requests in flight
finish for up to ``--shutdown-timeout`` seconds before it closes what is left. It prints
``kvcache proxy ready on http://HOST:PORT`` once it listens (what tests and scripts wait for);
``--port 0`` takes a free port and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvcache.errors import ConfigError
from kvcache.integrations.vllm.proxy.routing import ProxyConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvcache.integrations.vllm.proxy",
        description="OpenAI-compatible prefill/decode proxy for vLLM (docs/disaggregation.md)",
    )
    p.add_argument(
        "--prefill", nargs="+", required=True, metavar="URL", help="prefill instances, http://host:port"
    )
    p.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode instances, http://host:port"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to open a connection upstream"
    )
    p.add_argument("--prefill-timeout", type=float, default=600.0, help="seconds for a whole prefill call")
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="longest silence of a decode instance (between two stream chunks), seconds",
    )
    p.add_argument(
        "--health-timeout", type=float, default=5.0, help="seconds for /health and /v1/models calls"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight may take to finish after SIGTERM",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        config = ProxyConfig(
            prefill=tuple(a.prefill),
            decode=tuple(a.decode),
            connect_s=a.connect_timeout,
            prefill_s=a.prefill_timeout,
            read_s=a.read_timeout,
            health_s=a.health_timeout,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import aiohttp  # noqa: F401 - kvcache's own venv need not have it; vLLM's does
    except ImportError as exc:
        print(f"the proxy needs aiohttp (vLLM's environment has it): {exc}", file=sys.stderr)
        return 3
    asyncio.run(serve(config, a.host, a.port, a.shutdown_timeout))
    return 0


async def serve(config: ProxyConfig, host: str, port: int, shutdown_timeout: float) -> None:
    """Listen until SIGINT or SIGTERM, then shut down gracefully (the module docstring)."""
    from aiohttp import web

    from kvcache.integrations.vllm.proxy.app import build_app

    runner = web.AppRunner(
        build_app(config), access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        print(f"kvcache proxy ready on http://{bound_host}:{bound_port}", flush=True)
        await stop.wait()
        logging.getLogger("kvcache.proxy").info("stopping: finishing requests in flight")
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
