"""`sluice serve MODEL`: the OpenAI-compatible HTTP server (chat completions, completions, models, health).

Binds 127.0.0.1 unless told otherwise; with `--api-key` every request needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path

from ..errors import ConfigError
from .common import add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every request")
    g.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the folder's name)")
    g.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="requests that may wait behind the running generation; more get 503 (default 16)")


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def main(args: argparse.Namespace) -> int:
    import uvicorn  # imported here so the other commands start without the server stack

    from ..server import create_app

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if not is_loopback(args.host) and not args.api_key:
        print(f"sluice serve: warning: binding {args.host} without --api-key: anyone who can reach this port can "
              "use the model", file=sys.stderr)
    name = args.model_name or Path(args.model).resolve().name
    with load_from_args(args) as m:
        app = create_app(m, name, api_key=args.api_key, max_queue=args.max_queue)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"sluice serve: model {name!r} at http://{host}:{args.port}/v1 (context {m.cache.max_context} "
              f"tokens, queue {args.max_queue})", file=sys.stderr, flush=True)
        # A bounded graceful shutdown: open streams are cancelled by the app's lifespan, not waited for.
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    return 0
