"""`sluice serve MODEL --ray`: replicas of the model behind Ray Serve, answering `sluice serve`'s OpenAI-compatible API.

Ray Serve routes, health-checks and restarts; sluice adds no cluster code of its own. Two deployments:

- `Replica`, N of them: one model each, loaded with the usual load options on `threads` compute threads (its Ray
  CPUs) within its memory budget (server/replicas.py sizes both). `generate` streams one generation's text pieces.
  A replica takes one request at a time (max_ongoing_requests=1), so requests wait in the ingress, not inside a
  replica, and each goes to a free replica: the least loaded. A replica that dies loses only the generation it was
  running; Ray starts another in its place (a dead engine thread fails `check_health` too).
- `Ingress`, one, holding no weights: server/app.py's app -- the same routes, validation, errors, limits and
  --api-key as `sluice serve` -- with the replicas as its `Generations` (`RemoteGenerations`). Prompts are encoded
  and checked here (prompts.Prompts), so a refused request never takes a replica; generations wait here until a
  replica is free; one whose replica died before it produced any text runs again on another.

Ray is imported only when used (`pip install 'sluice[ray]'`); `sluice serve` without --ray never needs it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ClusterError, ConfigError, RequestError
from .options import LoadOptions
from .plan import plan
from .prompts import Prompts
from .server import schemas as S
from .server.app import create_app, generation_work
from .server.queue import Done, EngineWorker, Failed, Job, QueueFull
from .server.replicas import ModelNeed, Node, Sizing, size_replicas
from .units import format_bytes

logger = logging.getLogger("ray.serve")  # Serve collects its replicas' log lines under this name

APP = "sluice"  # the Ray Serve application's name
# Ray's seconds between two health checks of a replica (its default is 10): a replica whose engine thread died is
# replaced within this time (a dead process is noticed at once).
HEALTH_PERIOD_S = 5.0
# Tries of a replica's constructor (Ray's default is 20): a load that failed twice fails the same way again.
LOAD_TRIES = 2
# Requests the ingress takes at once beyond the generations it may hold (running and queued): /health, /v1/models
# and refusals, which take no replica. More than that wait in Ray's proxy.
INGRESS_SPARE = 64
# Times a generation is sent again after its replica died before it produced text (then no client saw any of it).
RESENDS = 2
# Generations a replica's engine thread may hold besides the running one: Ray sends it one request at a time, but a
# cancelled generation finishes its current token (up to a prefill chunk) after Ray already counts it as done.
REPLICA_QUEUE = 1


@dataclass(frozen=True)
class Started:
    """First item of a replica's stream: the replica took the generation (its process id, for logs and tests)."""

    pid: int


@dataclass(frozen=True)
class Finished:
    """Last item of a replica's stream: what the reply reports (generate.TextStream's fields)."""

    finish_reason: str
    completion_tokens: int


@dataclass(frozen=True)
class Refused:
    """Last item when the engine refused the request's values (a RequestError: 400 to the client)."""

    message: str


class Replica:
    """One model in this process; its generations run one at a time on an EngineWorker, as in `sluice serve`."""

    def __init__(self, path: str, options: dict[str, Any]):
        from .engine import Model

        self.model = Model(path, LoadOptions.make(**options))
        self.worker = EngineWorker(REPLICA_QUEUE)

    async def generate(self, ids: list[int], limit: int, stops: list[str], sampling: dict, streamed: bool):
        """Started, then the text pieces (`streamed`; else all the text in one piece at the end), then Finished (or
        Refused). Cancelling the call stops the generation before its next token."""
        yield Started(os.getpid())
        job = self.worker.submit(generation_work(self.model, ids, limit, stops, sampling))
        try:
            if streamed:
                async for piece in job.stream():
                    yield piece
            else:  # one Ray item, not one a token: Ray's processes spent 1.9 ms of CPU a token, not 4.0, and the
                # replica ~1 ms less (benchmarks/results/ray, resident against resident-stream)
                text, _ = await job.result()
                if text:
                    yield text
            yield Finished(job.outcome.finish_reason, job.outcome.completion_tokens)
        except RequestError as e:
            yield Refused(str(e))
        finally:
            job.cancel()  # no-op when finished; the caller left (or the replica stops) otherwise

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread has stopped is replaced."""
        if not self.worker.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:  # Ray's graceful shutdown of the replica
        worker, model = getattr(self, "worker", None), getattr(self, "model", None)
        if worker is not None:
            worker.close()
        if model is not None:
            model.close()


class RemoteGenerations:
    """The ingress's Generations: each generation is a streamed call to a replica through Ray's handle. Calls are
    made as replicas free up, one per replica, and the others wait here in arrival order: Ray's router then always
    has a free replica to pick, where a request waiting in it would poll the busy replicas with a back-off of up to
    0.5 s (ray 2.60 RequestRouterConfig), idling a replica that long after each generation. At most
    `replicas + max_queue` are held; more are QueueFull (503)."""

    def __init__(self, handle: Any, replicas: int, max_queue: int):
        self.handle, self.replicas, self.max_queue = handle, replicas, max_queue
        self.tasks: dict[Job, asyncio.Task] = {}  # called, not finished
        self.queue: collections.deque[tuple[Job, tuple]] = collections.deque()  # not called yet, in arrival order
        self.running = 0  # calls a replica has taken
        self._ids = itertools.count(1)

    def submit(self, ids: list[int], limit: int, stops: list[str], sampling: dict, streamed: bool) -> Job:
        held = len(self.tasks) + len(self.queue)
        if held >= self.replicas + self.max_queue:
            raise QueueFull(f"the server is busy: {self.running} generations running on {self.replicas} replicas "
                            f"and {held - self.running} waiting (--max-queue {self.max_queue}); retry later")
        job = Job(work=None, loop=asyncio.get_running_loop(), id=next(self._ids), _on_cancel=self._cancel)
        self.queue.append((job, (ids, limit, stops, sampling, streamed)))
        self._call_next()
        return job

    def health(self) -> dict:
        waiting = len(self.tasks) + len(self.queue) - self.running
        return {"busy": self.running > 0, "waiting": waiting, "running": self.running, "replicas": self.replicas}

    def close(self) -> None:
        for job, _ in self.queue:
            job.events.put_nowait(Done(Finished("cancelled", 0)))
        self.queue.clear()
        for task in list(self.tasks.values()):
            task.cancel()

    def _call_next(self) -> None:
        """Call a replica for the oldest waiting generation while fewer calls than replicas are out."""
        while self.queue and len(self.tasks) < self.replicas:
            job, args = self.queue.popleft()
            if not job.cancelled:
                self.tasks[job] = asyncio.ensure_future(self._run(job, args))

    def _cancel(self, job: Job) -> None:
        task = self.tasks.get(job)
        if task is not None:
            if job.outcome is None:  # else the reply has its end, and the call is read to its end (see _run)
                task.cancel()
        else:  # still waiting here: it leaves the queue now, freeing its place
            self.queue = collections.deque(entry for entry in self.queue if entry[0] is not job)
            job.state = "finished"

    def _state(self, job: Job, state: str) -> None:
        if job.state == "running":
            self.running -= 1
        if state == "running":
            self.running += 1
        job.state = state

    async def _run(self, job: Job, args: tuple) -> None:
        from ray.exceptions import RayActorError

        # text pieces posted: once there is one, a streaming client may have seen it and nothing is resent (a
        # replica sends the text of a request that is not streamed at its end: it is resent whenever it dies)
        produced = 0
        ended = False  # the outcome is posted; the stream is read to its end, when Ray counts the replica free
        try:
            for resend in itertools.count():
                call = self.handle.options(stream=True).generate.remote(*args)
                try:
                    async for item in call:
                        if isinstance(item, str):
                            produced += 1
                            job.events.put_nowait(item)
                        elif isinstance(item, Started):
                            self._state(job, "running")
                        elif isinstance(item, (Finished, Refused)):
                            ended = True
                            job.events.put_nowait(Done(item) if isinstance(item, Finished)
                                                  else Failed(RequestError(item.message)))
                    if not ended:
                        raise RuntimeError("the replica's stream ended without an outcome")
                    return
                except RayActorError as e:  # the replica's process died, or cannot be reached
                    if ended:
                        return
                    if produced or resend >= RESENDS:
                        job.events.put_nowait(Failed(S.ApiError(
                            503, f"the replica running this generation stopped ({type(e).__name__}) after "
                                 f"{produced} pieces of text; Ray is starting another: retry the request",
                            type="server_error", code="replica_lost", headers={"Retry-After": "1"})))
                        return
                    logger.warning("a replica stopped before job %d produced text (%s): sending it again", job.id,
                                   type(e).__name__)
                    self._state(job, "waiting")
                except BaseException:
                    call.cancel()  # the client left, or the ingress stops: stop the replica's generation too
                    raise
        except asyncio.CancelledError:
            if not ended:
                job.events.put_nowait(Done(Finished("cancelled", produced)))
        except Exception as e:  # noqa: BLE001 - the request gets the error (500), the ingress lives on
            if not ended:
                job.events.put_nowait(Failed(e))
        finally:
            self._state(job, "finished")
            self.tasks.pop(job, None)
            self._call_next()


class Ingress:
    """The ingress deployment's body: the OpenAI-compatible app over the replicas (see the module's doc)."""

    def __init__(self, replica: Any, prompts: Prompts, name: str, api_key: str | None, max_queue: int,
                 max_body: int, replicas: int):
        self.generations = RemoteGenerations(replica, replicas, max_queue)
        self.app_args = (prompts, name, api_key, max_queue, max_body)

    def __serve_build_asgi_app__(self):  # Ray Serve's hook: the ASGI app this deployment serves, built in the replica
        prompts, name, api_key, max_queue, max_body = self.app_args
        return create_app(prompts, name, api_key=api_key, max_queue=max_queue, max_body=max_body,
                          generations=self.generations)


def application(path: str | Path, options: dict[str, Any], prompts: Prompts, sizing: Sizing, *, name: str,
                api_key: str | None, max_queue: int, max_body: int):
    """The Ray Serve application: `sizing.replicas` Replicas of the model at `path` (load `options`, their threads
    and memory taken from `sizing`), behind one Ingress."""
    from ray import serve

    replica = serve.deployment(
        Replica, name="replica", num_replicas=sizing.replicas, max_ongoing_requests=1,
        ray_actor_options={"num_cpus": sizing.threads, "memory": sizing.need},
        health_check_period_s=HEALTH_PERIOD_S, max_constructor_retry_count=LOAD_TRIES)
    ingress = serve.deployment(
        serve.ingress()(Ingress), name="ingress", num_replicas=1,
        max_ongoing_requests=sizing.replicas + max_queue + INGRESS_SPARE,
        ray_actor_options={"num_cpus": 0})  # encodes prompts and relays text: it must not take a replica's CPU
    load = {**options, "threads": sizing.threads, "memory": sizing.memory}
    return ingress.bind(replica.bind(str(path), load), prompts, name, api_key, max_queue, max_body,
                        sizing.replicas)


# ---- the cluster: start or join it, deploy, serve until told to stop -------------------------------------------------

# Ray's object store on a cluster started here. Its default is 30% of the memory, which the replicas need; what goes
# through it are text pieces and prompts' ids, inlined in Ray's messages (Ray's minimum is 75 MiB).
OBJECT_STORE = 128 * 2**20
# How often the deploy wait reads Ray's status.
POLL_S = 0.5


def start_cluster(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or start a local one (None); True when it was started here (and is stopped
    by `stop_cluster`). A local cluster listens on loopback only: it is this server's, and machines join a cluster
    started with `ray start --head` instead (README)."""
    if address is None:
        # read by Ray when imported: node address 127.0.0.1 (ray_constants.ENABLE_RAY_CLUSTER), and no usage report
        # sent from a cluster sluice started on the user's behalf; a value the user set is kept
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # the raylet's worker_niceness: Ray starts its workers, the replicas here, at nice 15, below every ordinary
        # process on the machine; on a machine shared with other work a replica then gets a fraction of a CPU that
        # a plain `sluice serve` (nice 0) keeps whole. The replicas are what this cluster is for: nice 0
        os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        import ray
        from ray import serve  # noqa: F401  (its extra's packages: fastapi, aiohttp, ...)
    except ImportError as e:
        raise ConfigError(f"--ray needs Ray Serve ({e}): pip install 'sluice[ray]'") from None

    from .host.cpus import usable_cpus

    if address is None:
        ray.init(address="local", num_cpus=usable_cpus(), object_store_memory=OBJECT_STORE, include_dashboard=False)
        return True
    try:
        ray.init(address=address)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ClusterError(f"cannot join the Ray cluster at {address!r} (--ray-address): {e}; start one with "
                           "`ray start --head` and pass the address it prints") from None
    return False


def cluster_nodes() -> list[Node]:
    """The alive nodes' CPUs and the memory Ray schedules on each."""
    import ray

    return [Node(int(n["Resources"].get("CPU", 0)), int(n["Resources"].get("memory", 0)))
            for n in ray.nodes() if n.get("Alive")]


def deploy(app, host: str, port: int, stop: threading.Event) -> bool:
    """Run `app` behind Ray Serve's HTTP proxy on host:port and wait until its replicas run (True), or until `stop`
    is set (False). Ray's own messages say why they do not run yet (a replica waiting for resources, or loading); a
    failed deployment is a ClusterError in Ray's words."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run_many([serve.RunTarget(target=app, name=APP, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    said = ""
    while not stop.is_set():
        status = serve.status().applications.get(APP)
        state = status.status if status is not None else "NOT_STARTED"
        if state == "RUNNING":
            return True
        messages = [] if status is None else [status.message] + [d.message for d in status.deployments.values()]
        news = "; ".join(m for m in messages if m)
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ClusterError(f"the replicas did not start: {news or state}")
        if news and news != said:
            print(f"sluice serve: waiting for Ray: {news}", file=sys.stderr, flush=True)
            said = news
        stop.wait(POLL_S)
    return False


def stop_cluster(started: bool, deployed: bool) -> None:
    """Stop the cluster when it was started here (its processes end with it), else remove the application if it was
    deployed; disconnect."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if started:
            serve.shutdown()
        elif deployed:
            serve.delete(APP)
    finally:
        ray.shutdown()


def run(model: str | Path, options: LoadOptions, *, replicas: int | str, address: str | None, host: str, port: int,
        name: str, api_key: str | None, max_queue: int, max_body: int) -> None:
    """`sluice serve MODEL --ray`: plan the model here (its file and option errors come before any cluster starts),
    start or join the cluster, size the replicas to its nodes, deploy, and serve until SIGINT or SIGTERM; then
    remove the application (and stop the cluster started here)."""
    model = Path(model).resolve()  # the replicas' working folder may not be this one (other nodes: the same path)
    load_plan = plan(model, options)  # BudgetError, CheckpointError, ConfigError here, as `sluice serve` says them
    prompts = Prompts.of_plan(load_plan)
    if prompts.tokenizer is None:
        raise ConfigError("the server needs a model folder with tokenizer.json (text in, text out)")
    started = start_cluster(address)
    stop, deployed = threading.Event(), False
    try:
        # ray.init installed its own SIGTERM handler: a stop signal ends the wait below, the cleanup runs after it
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        nodes = cluster_nodes()
        sizing = size_replicas(ModelNeed.of_plan(load_plan), nodes, replicas, options.threads, options.memory)
        load = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        app = application(model, load, prompts, sizing, name=name, api_key=api_key, max_queue=max_queue,
                          max_body=max_body)
        deployed = True  # from here on the cluster may hold some of it
        if not deploy(app, host, port, stop):
            return
        url = f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"
        print(f"sluice serve: model {name!r} at {url} on Ray ({'a local cluster' if started else address}): "
              f"{sizing.describe()}; context {prompts.max_context} tokens, queue {max_queue}, body up to "
              f"{format_bytes(max_body)}", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        stop_cluster(started, deployed)
