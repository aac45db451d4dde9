"""One generation at a time on the engine, a bounded wait queue in front of it, cancellation between tokens.

The engine owns one KV cache and one expert store, so two generations cannot interleave. A single worker thread
runs jobs in arrival order; the event loop only submits jobs and reads their events, so a long prefill never
blocks other HTTP traffic (health checks, 503s for a full queue). A job is a plain function run on the worker
thread: `work(emit, cancelled) -> result`. It calls `emit(piece)` per text piece and polls `cancelled()` between
tokens; the event loop side sees the pieces, then the result or the error, on an asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

Work = Callable[[Callable[[str], None], Callable[[], bool]], Any]


class QueueFull(Exception):
    """Every wait slot is taken: the request is refused (HTTP 503) instead of waiting without bound."""


@dataclass
class Done:
    """Last event of a job that ran to its end (or stopped on cancellation): the work function's result."""

    result: Any


@dataclass
class Failed:
    """Last event of a job whose work function raised."""

    error: BaseException


@dataclass(eq=False)
class Job:
    """A submitted generation: its events arrive on `events`; `cancel()` stops it between two tokens."""

    work: Work | None  # None: the job runs elsewhere and its events are posted by whoever runs it (serve_ray.py)
    loop: asyncio.AbstractEventLoop
    id: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "waiting"  # waiting -> running -> finished (or waiting -> finished when cancelled early)
    outcome: Any = None  # the work function's result, once `stream()` or `result()` has seen it
    _cancel: threading.Event = field(default_factory=threading.Event)
    # told of a cancel: the EngineWorker frees a waiting job's slot; a remote job stops its call (serve_ray.py)
    _on_cancel: Callable[[Job], None] | None = None

    def cancel(self) -> None:
        """Stop the job: a waiting job leaves the queue now, a running one stops before its next token."""
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _post(self, event: Any) -> None:
        # From the worker thread into the loop. A closed loop (server shut down) means nobody listens: stop.
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self._cancel.set()

    async def stream(self) -> AsyncIterator[str]:
        """Yield text pieces as they come; on Done set `outcome` and return; on Failed raise the work's error."""
        while True:
            event = await self.events.get()
            if isinstance(event, str):
                yield event
            elif isinstance(event, Failed):
                raise event.error
            else:
                self.outcome = event.result
                return

    async def result(self) -> tuple[str, Any]:
        """Wait for the end of the job: (all its text, the work function's result); raise its error."""
        pieces = [piece async for piece in self.stream()]
        return "".join(pieces), self.outcome


class EngineWorker:
    """A thread that runs jobs one at a time, with at most `max_queue` jobs waiting behind the running one."""

    def __init__(self, max_queue: int):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Job | None = None
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="sluice-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Jobs queued behind the running one."""
        return self._waiting

    @property
    def busy(self) -> bool:
        """Whether a generation is running now."""
        return self._running is not None

    @property
    def alive(self) -> bool:
        """Whether the worker thread still runs jobs (False after `close()`)."""
        return self._thread.is_alive()

    def submit(self, work: Work) -> Job:
        """Queue `work`; raise QueueFull when the engine is busy and `max_queue` jobs already wait.

        Must be called from the event loop that will read the job's events.
        """
        job = Job(work=work, loop=asyncio.get_running_loop(), id=next(self._ids), _on_cancel=self._drop_if_waiting)
        with self._lock:
            # Counted against the limit: jobs that wait, plus this one when it could not start right away.
            occupied = self._waiting + (1 if self._running is not None else 0)
            if occupied > self.max_queue:
                raise QueueFull(
                    f"the server is busy: 1 generation running and {self._waiting} waiting "
                    f"(--max-queue {self.max_queue}); retry later"
                )
            self._waiting += 1
        self._jobs.put(job)
        return job

    def _drop_if_waiting(self, job: Job) -> None:
        with self._lock:
            if job.state == "waiting":
                job.state = "finished"
                self._waiting -= 1  # frees its wait slot now, not when the worker reaches it

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.state != "waiting":  # cancelled while it waited
                    continue
                job.state = "running"
                self._waiting -= 1
                self._running = job
            try:
                result = job.work(job._post, job._cancel.is_set)
                job._post(Done(result))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the request, the thread lives on
                job._post(Failed(e))
            finally:
                with self._lock:
                    job.state = "finished"
                    self._running = None

    def close(self, timeout: float = 5.0) -> None:
        """Cancel everything queued or running and stop the thread (waits up to `timeout` for the current token)."""
        with self._lock:
            running = self._running
        if running is not None:
            running.cancel()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job._post(Done(None))
        self._jobs.put(None)
        self._thread.join(timeout)
