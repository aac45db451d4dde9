"""`sluice serve MODEL`: the OpenAI-compatible HTTP server (chat completions, completions, models, health).

Binds 127.0.0.1 unless told otherwise; with `--api-key` every request needs `Authorization: Bearer KEY`. The
address is bound before the model loads, so a port in use is one error line at once, not a failure after minutes
of loading; uvicorn is handed that socket, so no other process can take the port in between.

With `--ray` the same API is served by replicas of the model behind Ray Serve (serve_ray.py), on a local Ray cluster
or the one at `--ray-address`; the port is checked the same way before the cluster starts, then left to Ray's proxy.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import ipaddress
import math
import resource
import socket
import sys
from pathlib import Path

from ..errors import ConfigError
from ..units import format_bytes, parse_size
from ..options import options_from_args
from ..server.replicas import parse_replicas
from .common import add_model_arguments, load_from_args

# Waiting requests beyond the running one. Each holds its prompt (up to the context) while it waits, and requests
# run one at a time for seconds to minutes each: a longer queue only makes clients wait past their timeouts
# (the openai client's default is 10 minutes) while holding memory.
MAX_QUEUE = 1024
# Files the process holds beside its connections: the model's files, the listening socket, the event loop's, stdio.
FILES_BESIDE_CONNECTIONS = 64
# --read-timeout and --max-connections when not given (their flags default to None: under --ray, where Ray's proxy
# holds the connections, giving them is an error instead of being ignored)
READ_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 = any free port)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every request")
    g.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the folder's name)")
    g.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help=f"requests that may wait behind the running generation; more get 503 (default 16, at most "
                        f"{MAX_QUEUE})")
    g.add_argument("--max-body", default="4MiB", metavar="SIZE",
                   help="largest request body; larger ones get 413 before they are read (default 4MiB: a 256K-token "
                        "context of text, even JSON-escaped)")
    g.add_argument("--read-timeout", type=float, default=None, metavar="SECONDS",
                   help="a client must send a request's head whole within this time, and may not pause its body "
                        f"longer; else 408 and the connection is closed (default {READ_TIMEOUT_S:g}; not with --ray)")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections at once; one more gets 503 and is closed. Must exceed --max-queue: each "
                        f"waiting request holds one (default {MAX_CONNECTIONS}; not with --ray)")
    r = p.add_argument_group("replicas (Ray Serve)")
    r.add_argument("--ray", action="store_true",
                   help="serve replicas of the model behind Ray Serve (pip install 'sluice[ray]'): a local Ray "
                        "cluster, or the one at --ray-address; each replica loads the model with the flags above, "
                        "--threads being its CPUs (default: off, one model in this process)")
    r.add_argument("--replicas", default=None, metavar="N|auto",
                   help="--ray: replicas of the model; auto = as many as the cluster's nodes hold, from the CPUs "
                        "(--threads, default 1 for auto) and the memory each needs (default 1)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="--ray: join the Ray cluster at ADDR (`ray start --head` prints it) instead of starting a "
                        "local one; the model's path must exist on every node (default: a local cluster, on "
                        "loopback only)")


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening), as uvicorn would bind it; a ConfigError naming the
    address and what to do when that fails."""
    name = host.strip("[]")
    where = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    sock = socket.socket(socket.AF_INET6 if ":" in name else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # uvicorn's choice: restart over TIME_WAIT
    try:
        sock.bind((name, port))
    except socket.gaierror as e:
        sock.close()
        raise ConfigError(f"cannot listen on {where}: host {name!r} does not resolve ({e.strerror}); give an "
                          "address such as 127.0.0.1 or 0.0.0.0") from e
    except OSError as e:
        sock.close()
        advice = {
            errno.EADDRINUSE: "another process listens there: stop it, or choose another --port",
            errno.EACCES: "ports below 1024 need root (or CAP_NET_BIND_SERVICE): choose a --port of 1024 or more",
            errno.EADDRNOTAVAIL: "this machine has no such address: use 127.0.0.1, 0.0.0.0 or one of its own "
                                 "addresses as --host",
        }.get(e.errno, "check --host and --port")
        raise ConfigError(f"cannot listen on {where}: {e.strerror}: {advice}") from e
    sock.set_inheritable(True)
    return sock


def check_connections(max_connections: int, max_queue: int) -> None:
    """--max-connections must leave room for the queue, and the process must be allowed that many open files (the
    soft limit is raised toward the hard one when needed), else the cap would be EMFILE instead of a 503."""
    if max_connections <= max_queue:
        raise ConfigError(f"--max-connections ({max_connections}) must be more than --max-queue ({max_queue}): each "
                          "waiting request holds a connection, and so does the running one")
    need = max_connections + FILES_BESIDE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        refused = f"--max-connections {max_connections} needs about {need} open files, and this process may open"
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ConfigError(f"{refused} {hard} (ulimit -Hn): lower --max-connections")
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        except (ValueError, OSError) as e:  # past the kernel's fs.nr_open
            raise ConfigError(f"{refused} {soft} ({e}): lower --max-connections") from e


def check_ray_flags(args: argparse.Namespace) -> None:
    """The replica flags go with --ray, the connection limits without it; --ray needs Ray Serve installed."""
    if not args.ray:
        given = [f for f, v in (("--replicas", args.replicas), ("--ray-address", args.ray_address)) if v is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} --ray")
        return
    given = [f for f, v in (("--read-timeout", args.read_timeout), ("--max-connections", args.max_connections))
             if v is not None]
    if given:
        raise ConfigError(f"{' and '.join(given)}: under --ray, Ray Serve's HTTP proxy holds the connections and "
                          "these limits do not apply; leave them out")
    if args.replicas is not None:
        parse_replicas(args.replicas)
    if importlib.util.find_spec("ray") is None:  # (not "ray.serve": finding it imports ray, see serve_ray.py)
        raise ConfigError("--ray needs Ray Serve, which is not installed: pip install 'sluice[ray]'")


def main(args: argparse.Namespace) -> int:
    import uvicorn  # imported here so the other commands start without the server stack

    from ..server.app import check_model_name, create_app
    from ..server.http import Limits, uvicorn_config

    check_ray_flags(args)
    if not 0 <= args.max_queue <= MAX_QUEUE:
        raise ConfigError(f"--max-queue must be in 0..{MAX_QUEUE}, got {args.max_queue}")
    if not args.ray:
        read_timeout = READ_TIMEOUT_S if args.read_timeout is None else args.read_timeout
        if not (math.isfinite(read_timeout) and read_timeout > 0):
            raise ConfigError(f"--read-timeout must be a positive number of seconds, got {read_timeout:g}")
        max_connections = MAX_CONNECTIONS if args.max_connections is None else args.max_connections
        check_connections(max_connections, args.max_queue)
        limits = Limits(read_timeout=read_timeout, max_connections=max_connections)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    max_body = parse_size(args.max_body, "--max-body")
    name = args.model_name or Path(args.model).resolve().name
    check_model_name(name)
    sock = bind(args.host, args.port)
    if not is_loopback(args.host) and not args.api_key:
        print(f"sluice serve: warning: binding {args.host} without --api-key: anyone who can reach this port can "
              "use the model", file=sys.stderr)
    if args.ray:
        port = sock.getsockname()[1]  # the port asked for, or the free one the system chose for --port 0
        sock.close()  # Ray's proxy binds it (another process could take it in between: then Ray says so)
        from .. import serve_ray

        serve_ray.run(args.model, options_from_args(args), replicas=parse_replicas(args.replicas or "1"),
                      address=args.ray_address, host=args.host, port=port, name=name, api_key=args.api_key,
                      max_queue=args.max_queue, max_body=max_body)
        return 0
    try:
        with load_from_args(args) as m:
            app = create_app(m, name, api_key=args.api_key, max_queue=args.max_queue, max_body=max_body)
            host, port = sock.getsockname()[:2]
            url = f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"
            print(f"sluice serve: model {name!r} at {url} (context {m.cache.max_context} tokens, queue "
                  f"{args.max_queue}, body up to {format_bytes(max_body)}, read timeout {limits.read_timeout:g} s, "
                  f"up to {limits.max_connections} connections)", file=sys.stderr, flush=True)
            uvicorn.Server(uvicorn_config(app, limits)).run(sockets=[sock])
    finally:
        sock.close()
    return 0
