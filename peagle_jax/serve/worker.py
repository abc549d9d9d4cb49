"""The engine thread: one background thread owns the :class:`SlotEngine` and drives its step loop.

The HTTP side (asyncio) talks to it only through thread-safe queues: :meth:`EngineWorker.submit` and
:meth:`EngineWorker.cancel` put messages in an inbox, and each request's events come back through the
``deliver`` callback it was submitted with (the server's callback hops onto the event loop with
``call_soon_threadsafe``). The queue of requests waiting for a slot is bounded: beyond ``max_queue`` past
the free slots, :meth:`submit` raises :class:`QueueFull` at once (the server answers 429).

The thread never dies on a request: a failure while admitting one request ends that request with an error
event; a failure inside a step ends every active request with an error and starts over with fresh caches.

With ``background`` compilation (the server's default) the engine thread compiles only the first graphs
(:func:`peagle_jax.serve.warmup.first_tasks`) before :attr:`EngineWorker.ready` is set; a second thread then
compiles the rest on the engine's :meth:`~peagle_jax.serve.slots.SlotEngine.shadow` while requests are
served (:attr:`EngineWorker.graphs_pending` counts down). The engine thread never compiles one of those
itself: a drafting step runs plain until its graphs are there, and a plain step or an admission that needs
a missing graph waits for it, which the compiler then takes next; the engine thread meanwhile goes on
taking cancellations, so a client that disconnects frees its slot at once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable

from peagle_jax import executables
from peagle_jax.engine.generator import RequestError
from peagle_jax.errors import UserError
from peagle_jax.serve.metrics import Metrics
from peagle_jax.serve.slot_io import SlotEvent, SlotRequest
from peagle_jax.serve.slots import SlotEngine
from peagle_jax.serve.warmup import TaskQueue, first_tasks
from peagle_jax.spec.plan import StepKey

log = logging.getLogger("peagle_jax.serve")


class QueueFull(Exception):
    """More requests are waiting than ``max_queue``."""


class _Stopped(Exception):
    """Background compilation was asked to stop (:meth:`EngineWorker.shutdown`)."""


@dataclasses.dataclass
class Failure:
    """The request could not be served; ``message`` is safe to show the client."""

    request: SlotRequest
    message: str
    status: int = 500


Deliver = Callable[[SlotEvent | Failure], None]


def _drafting(task) -> bool:
    """Whether a warm-up task is a drafting step's (which the engine replaces by a plain step until compiled)."""
    return isinstance(task, StepKey) and task.tree.depth > 0


class EngineWorker:
    def __init__(self, engine: SlotEngine, *, max_queue: int = 64, metrics: Metrics | None = None):
        self.engine, self.max_queue = engine, max_queue
        self.metrics = metrics or Metrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[tuple[SlotRequest, Deliver]] = collections.deque()
        self._deliver: dict[int, Deliver] = {}
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet in a slot (inbox + waiting)
        # The engine's free slots as the engine thread last saw them, updated under the lock together with
        # _queued: an admission takes a slot and leaves the queue in one step for submit()'s check (reading
        # engine.free itself, a request the engine thread was admitting counted as queued and in a slot).
        self._free = engine.B
        self.ready = threading.Event()  # set once the graphs are compiled
        self.failed: str | None = None  # set if the warm-up itself failed
        self.user_error = False  # ... with a UserError (then the server exits with its message)
        self.warmup_s = 0.0  # until ready
        self.graphs_total = self.graphs_compiled = 0  # warm-up tasks (graphs) in all, and done so far
        self._compile_s = 0.0  # seconds of the compile phases done
        self._compiling_since: float | None = None  # when the running compile phase started
        self.background_failed: str | None = None  # why background compilation stopped early
        self._thread = threading.Thread(target=self._run, name="peagle-engine", daemon=True)
        self._compiler: threading.Thread | None = None  # the background compilation, while it runs
        self._stop = threading.Event()

    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling so far (before ready, then in the background)."""
        since = self._compiling_since
        return self._compile_s + (time.perf_counter() - since if since is not None else 0.0)

    @property
    def graphs_pending(self) -> int:
        """Graphs still to compile (in the background once ready)."""
        return self.graphs_total - self.graphs_compiled

    def start(self, *, warmup: bool = True, background: bool = False, progress=None) -> None:
        """Start the engine thread: compile every graph first (``warmup``), or with ``background`` only the
        first ones and the rest on another thread while serving. ``progress(phase, done, total)``: ``phase``
        is "start" (before ready) or "background"; ``done`` and ``total`` count that phase's graphs."""
        self._warm, self._background, self._progress = warmup, background, progress
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop_compiling(self) -> None:
        """Ask the compilation (before ready, or in the background) to stop after the graph it is on."""
        self._stop.set()

    def shutdown(self, timeout: float = 300) -> bool:
        """Stop compiling after the graph being compiled, before ready or in the background, and wait for it
        (a process that exits while XLA compiles on another thread can abort). Returns whether it stopped
        within ``timeout`` seconds."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        if self._thread.is_alive() and not self.ready.is_set():
            self._thread.join(timeout)
        compiler = self._compiler
        if compiler is not None:
            compiler.join(max(deadline - time.monotonic(), 0))
            return not compiler.is_alive()
        return not (self._thread.is_alive() and not self.ready.is_set())

    def submit(self, req: SlotRequest, deliver: Deliver) -> None:
        """Queue ``req``; :class:`QueueFull` when more than ``max_queue`` requests would wait beyond the free
        slots (requests the engine thread has not admitted yet take free slots first, so a burst of exactly
        slots + ``max_queue`` is accepted whole)."""
        with self._lock:
            if self._queued - self._free >= self.max_queue:
                raise QueueFull
            self._queued += 1
        self._inbox.put(("submit", req, deliver))

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id, None))

    # -- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._warm:
            executables.stop_ahead()  # the warm-up's mapping budget counts only what its own graphs load
            tasks = self.engine.warmup_tasks()
            first, rest = first_tasks(tasks, self.engine.gen.window_buckets[0]) if self._background else (tasks, [])
            self.graphs_total = len(tasks)
            self.engine.compiling.update(rest)
            self._compiling_since = time.perf_counter()
            try:
                progress = self._counter("start", len(first))
                self.warmup_s = self.engine.warmup(progress=progress, tasks=first, calibrate=not rest)
            except _Stopped:  # shut down before it was ready
                return
            except UserError as err:  # e.g. too many graphs for this machine: the message says what to do
                self.failed, self.user_error = str(err), True
                log.error("warm-up failed: %s", err)
                return
            except Exception:  # noqa: BLE001 - reported by /health, the process keeps serving errors
                self.failed = traceback.format_exc()
                log.error("warm-up failed:\n%s", self.failed)
                return
            finally:
                self._compile_s, self._compiling_since = self.compile_s, None
                executables.drop_ahead()  # what the first graphs did not take waits for its first call
            if rest:
                self._compiling_since = time.perf_counter()
                rest = TaskQueue(rest)
                self.engine.on_missing = rest.urgent  # a step or an admission waiting for a graph: compiled next
                compiler = threading.Thread(target=self._compile, args=(rest,), name="peagle-compile", daemon=True)
                self._compiler = compiler
                compiler.start()
        self.ready.set()
        while True:
            idle = not self._waiting and self.engine.active == 0
            # While the engine waits for a graph compiling in the background, cancellations are still taken
            # every 20 ms (a client that leaves frees its slot at once, whatever the engine waits for).
            self._drain(block=idle or self.engine.waiting_for is not None, timeout=0.5 if idle else 0.02)
            while self._waiting and self.engine.free and self.engine.admission_ready(self._waiting[0][0]):
                req, deliver = self._waiting.popleft()
                self._admit(req, deliver)
                with self._lock:  # counted as queued until it holds its slot (or failed): never neither
                    self._queued -= 1
                    self._free = self.engine.free
            if self.engine.active:
                self._step()
            with self._lock:  # slots freed by the step or by cancellations
                self._free = self.engine.free

    def _counter(self, phase: str, graphs: int):
        """A warm-up progress callback counting compiled graphs (the calibration's timed steps after them
        compile nothing) and passing (phase, done, total) on."""
        base = self.graphs_compiled

        def progress(done, total):
            if self._stop.is_set():
                raise _Stopped
            self.graphs_compiled = base + min(done, graphs)
            if self._progress:
                self._progress(phase, done, total)

        return progress

    def _compile(self, rest) -> None:
        """The background thread: compile ``rest`` on a shadow engine, then hand its calibrated step times
        to the serving engine. A failure is logged; the steps whose graphs are missing then run plain (a
        drafting step) or compile when first called (a plain step, a prefill)."""
        t0 = self._compiling_since
        try:
            shadow = self.engine.shadow()
            shadow.warmup(progress=self._counter("background", len(rest)), tasks=rest)
            if shadow.policy is not None:
                self.engine.adopt_times(shadow.policy)
            log.info("background compilation done: %d graphs in %.1f s", len(rest), time.perf_counter() - t0)
        except _Stopped:
            log.info("background compilation stopped: the server is shutting down")
        except UserError as err:
            self.background_failed = str(err)
            log.error("background compilation stopped: %s", err)
        except Exception:  # noqa: BLE001 - the server goes on with the graphs it has
            self.background_failed = traceback.format_exc()
            log.error("background compilation failed:\n%s", self.background_failed)
        finally:
            self._compile_s, self._compiling_since = self.compile_s, None
            # Whatever did not compile (a failure, a shutdown) now compiles when first called, on the engine's
            # thread, rather than being waited for; a drafting step still missing keeps running plain where
            # plain steps are served.
            engine, plain = self.engine, self.engine.choice.plain_served
            engine.compiling.difference_update([t for t in list(engine.compiling) if not (plain and _drafting(t))])

    def _drain(self, block: bool, timeout: float = 0.5) -> None:
        try:
            msg = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, a, b = msg
            if kind == "submit":
                self._waiting.append((a, b))
            else:
                self._cancel(a)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, request_id: int) -> None:
        for i, (req, _) in enumerate(self._waiting):
            if req.id == request_id:
                del self._waiting[i]
                with self._lock:
                    self._queued -= 1
                return
        if self.engine.cancel(request_id) is not None:
            self._deliver.pop(request_id, None)

    def _admit(self, req: SlotRequest, deliver: Deliver) -> None:
        t0 = time.perf_counter()
        try:
            event = self.engine.admit(req)
        except RequestError as err:
            deliver(Failure(req, str(err), 400))
            return
        except Exception:  # noqa: BLE001 - one request's failure must not stop the others
            log.error("admitting request %d failed:\n%s", req.id, traceback.format_exc())
            deliver(Failure(req, "internal error while starting this request", 500))
            self.engine.cancel(req.id)
            if self.engine.caches_lost():  # it failed after donating the caches: the running requests end too
                self._fail_running()
            return
        self.metrics.first_token(time.perf_counter() - t0)
        self._deliver[req.id] = deliver
        self._send(event)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception:  # noqa: BLE001 - end the active requests, keep serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_running()
            return
        self.metrics.step(time.perf_counter() - t0)
        for event in events:
            self._send(event)

    def _fail_running(self) -> None:
        """End every running request with an error and start over with fresh caches (a failed call may
        have consumed the donated ones)."""
        lost = [slot.request for slot in self.engine.slots if slot is not None]
        self.engine.reset()
        for req in lost:
            deliver = self._deliver.pop(req.id, None)
            if deliver is not None:
                deliver(Failure(req, "internal error while generating", 500))

    def _send(self, event: SlotEvent) -> None:
        rid = event.request.id
        deliver = self._deliver.pop(rid) if event.finish_reason else self._deliver.get(rid)
        if deliver is not None:
            deliver(event)
