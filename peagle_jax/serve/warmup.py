"""Compiling the serving engine's graphs before requests need them: the warm-up tasks, the warm-up itself, the
adaptive policy's calibration, and the shadow engine that compiles in the background while the engine serves.

Every graph a request can reach is a task (:func:`warmup_tasks`): the 1-row admission of each prefill length
(:class:`Admit`) and each step key (:class:`peagle_jax.spec.plan.StepKey`: row bucket, step tree, window,
sampling mode). :func:`warm_up` runs each once on scratch rows placed by the inverses of the window rule
(:class:`peagle_jax.spec.plan.Windows`), so that the step lands in the key's window. A server compiles the
first tasks (:func:`first_tasks`: what a short prompt's first request needs) before it serves and the rest on
a :func:`shadow`: an engine of the same shapes with its own caches, whose steps compile into the same jit
caches on another thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from peagle_jax.engine.buckets import bucket
from peagle_jax.engine.overlap import merge_roots
from peagle_jax.platform import MapBudget
from peagle_jax.sampling import greedy_graph, greedy_modes
from peagle_jax.serve.slot_io import SlotRequest
from peagle_jax.spec.adaptive import CALIBRATION_STEPS
from peagle_jax.spec.plan import StepKey, step_keys
from peagle_jax.spec.tree import Tree, chain


@dataclasses.dataclass(frozen=True)
class Admit:
    """A warm-up task: admitting a prompt of ``length`` tokens (its prefill chunks and the first-token
    sampler, greedy or sampling by ``temperature``)."""

    length: int
    temperature: float = 0.0


WarmTask = Admit | StepKey


def first_tasks(tasks: Sequence[WarmTask], smallest_window: int) -> tuple[list[WarmTask], list[WarmTask]]:
    """Split an ordered :func:`warmup_tasks` list into what a server compiles before it serves (the admissions
    of prompts within the smallest window and the plain step over one row there) and the rest."""

    def first(task: WarmTask) -> bool:
        if isinstance(task, Admit):
            return task.length <= smallest_window
        return task.rows == 1 and task.window == smallest_window and not task.tree.depth

    return [t for t in tasks if first(t)], [t for t in tasks if not first(t)]


def admit_lengths(gen) -> list[int]:
    """The prompt lengths whose admissions compile every prefill graph: each chunk start plus each bucket."""
    chunk = gen.prefill_buckets[-1]
    starts = range(0, gen.max_seq_len - 1, chunk)
    return sorted({min(start + T, gen.max_seq_len - 1) for start in starts for T in gen.prefill_buckets})


def admit_tasks(gen, length: int, temperature: float = 0.0) -> list[Admit]:
    """The :class:`Admit` tasks whose graphs an admission of a ``length``-token prompt calls: one per prefill
    chunk (the task whose last chunk is that one), and the sampled first-token variant where it is a graph of
    its own."""
    chunk = gen.prefill_buckets[-1]
    tasks = []
    for start in range(0, length, chunk):
        T = bucket(min(length - start, chunk), gen.prefill_buckets)
        tasks.append(Admit(min(start + T, gen.max_seq_len - 1)))
    if len(greedy_modes()) > 1 and not greedy_graph(temperature):
        tasks.append(Admit(admit_lengths(gen)[0], 1.0))
    return tasks


class TaskQueue:
    """Warm-up tasks in order, of which another thread may move some to the front (:meth:`urgent`): the
    serving engine asks for the graphs a step or an admission is waiting for."""

    def __init__(self, tasks: Iterable[WarmTask]):
        self._tasks = list(tasks)
        self._total = len(self._tasks)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._total

    def __iter__(self) -> Iterator[WarmTask]:
        while True:
            with self._lock:
                if not self._tasks:
                    return
                task = self._tasks.pop(0)
            yield task

    def urgent(self, task: WarmTask) -> None:
        """Compile ``task`` next, if it is still to come. Thread-safe."""
        with self._lock:
            if task in self._tasks:
                self._tasks.remove(task)
                self._tasks.insert(0, task)


def warmup_tasks(engine) -> list[WarmTask]:
    """Every graph a request can reach, in the order requests are likely to need them (small windows, few rows
    and plain steps first): the 1-row admission of each prefill length bucket (greedy; where the first-token
    sampler has a sampling variant, one sampled admission too) and the step of every (row bucket, step tree,
    attention window, sampling mode: see :func:`peagle_jax.sampling.greedy_modes`)."""
    gen = engine.gen
    lengths = admit_lengths(gen)
    keys = step_keys(engine.row_buckets, engine.choice.trees(), gen.window_buckets, greedy_modes())
    admits = [Admit(n) for n in lengths] + [Admit(lengths[0], 1.0)] * (len(greedy_modes()) - 1)

    def order(task: WarmTask):
        if isinstance(task, Admit):
            return gen.window(task.length), 1, 0, task.temperature > 0
        return task.window, task.rows, task.tree.depth > 0, not task.greedy_only

    return sorted([*admits, *keys], key=order)  # stable: admissions by length, keys as step_keys lists them


def warm_up(engine, progress=None, tasks: Sequence[WarmTask] | None = None, *, calibrate: bool = True) -> float:
    """:meth:`peagle_jax.serve.slots.SlotEngine.warmup`: compile ``tasks`` (default every :func:`warmup_tasks`;
    a :class:`TaskQueue` is taken as it is, so that another thread can reorder it meanwhile) and the small
    graphs around them (the root merge of an overlapped plain step, the token counts); with the adaptive
    policy and ``calibrate``, then time every step length at every row bucket. A task leaves the policy's
    ``compiling`` set once compiled. ``progress(done, total)`` is called as it goes. Returns the seconds
    spent."""
    t0 = time.perf_counter()
    gen, choice = engine.gen, engine.choice
    if not isinstance(tasks, TaskQueue):
        tasks = TaskQueue(warmup_tasks(engine) if tasks is None else tasks)
    calibration = len(engine.row_buckets) * len(choice.choices) * CALIBRATION_STEPS if choice.adaptive else 0
    calibration *= calibrate
    total = len(tasks) + calibration  # the calibration's timed steps compile nothing: not in the budget
    budget = MapBudget(len(tasks), f"{engine.B} slots x {gen.max_seq_len} tokens ({engine.describe()})")
    done = 0
    # Every row keeps its drafter current meanwhile, so that the flushes compile too (a warm-up that fails
    # leaves the engine unserved: the worker reports it and takes no request).
    lazy, choice.lazy = choice.lazy, False

    def advance():
        nonlocal done
        done += 1
        if done <= len(tasks):
            budget.check(done)
        if progress:
            progress(done, total)

    for rows in engine.row_buckets:
        merge_roots(*(jnp.zeros(rows, dt) for dt in (bool, np.int32, np.int32)))
        engine.rows.warm_counts(rows, sorted({1, gen.K + 1}) if engine.speculative else [1])
    for task in tasks:
        if isinstance(task, Admit):
            ev = engine.admit(SlotRequest([0] * task.length, 1, temperature=task.temperature, stop_token_ids=[]))
            assert ev.finish_reason == "length"
        else:  # one live row (the last of the row bucket) placed so that the step's window is the key's
            warm_step(engine, task.window, 0.0 if task.greedy_only else 1.0, task.tree, slot=task.rows - 1)
        choice.compiling.discard(task)
        advance()
    if choice.adaptive is not None:  # the steps above compiled: their times and acceptance mean nothing
        choice.fresh_adaptive()
        for rows in engine.row_buckets if calibrate else ():
            choice.adaptive.calibrate_all(
                rows, lambda k, r=rows: time_step(engine, choice.choices[k], slot=r - 1), advance
            )
    engine.forget_statistics()
    choice.lazy = lazy
    engine.reset()
    return time.perf_counter() - t0


def shadow(engine):
    """An engine of the same shapes and graphs with its own caches, statistics and policy, sharing
    ``engine``'s ``compiling`` set: its warm-up compiles, on another thread, the graphs ``engine`` then calls
    without compiling (the jit caches are shared). It holds a second set of caches."""
    c = engine.choice
    twin = type(engine)(
        engine.gen.twin(), engine.B, load_k=c.load_k, adaptive=c.adaptive is not None, chains=c.chains,
        logprobs=engine.logprobs, grammars=engine.rows.grammars, rules=engine.rows.rules,
    )  # fmt: skip
    twin.overlap, twin.choice.compiling = engine.overlap, c.compiling
    return twin


def _scratch_row(engine, b: int, temperature: float) -> None:
    """Slot b holds a scratch request that never ends (a warm-up's)."""
    engine.hold(b, SlotRequest([0], 1 << 30, temperature=temperature, stop_token_ids=[]))


def time_step(engine, tree: Tree, slot: int) -> float:
    """Seconds of one compiled greedy step drafting ``tree`` (depth 0: a plain step) with one busy slot
    (``slot``: the row bucket) in the smallest window. The adaptive policy starts from these times, so the
    first requests at each load do not pay for measuring the slower step lengths (the times are refined by
    every step served; the acceptance is learnt from traffic only)."""
    gen, b, s = engine.gen, slot, engine.state
    _scratch_row(engine, b, 0.0)
    q = max(gen.windows.verify_q(gen.window_buckets[0], gen.tree), 1)
    s.q[b], s.ctx_start[b], s.ctx_count[b] = q, q - 1, 1  # one queued context element: no flush
    t0 = time.perf_counter()
    engine.step(tree)
    seconds = time.perf_counter() - t0
    engine.release(b)
    return seconds


def warm_step(engine, w: int, temperature: float, tree: Tree | None = None, slot: int = 0) -> None:
    """One step with a single busy slot (``slot``, which sets the row bucket) placed so that the step's window
    is ``w``."""
    gen, b, s = engine.gen, slot, engine.state
    _scratch_row(engine, b, temperature)
    if not engine.speculative:
        s.q[b] = gen.windows.plain_q(w)
        engine.step(chain(0))
    else:
        tree = tree or gen.tree
        # q at the top and the bottom of the bucket, ctx_start up to K + 1 behind q: every draft window a step
        # with verify window w can meet (the fused graph compiles per pair). A plain step runs with a full
        # queue, so that it also compiles make_room's drafter write for this window.
        top, bottom = gen.windows.verify_q(w, tree), gen.windows.below(w) - tree.size
        for q in sorted({max(top, 1), max(bottom, 1)}):
            for start in sorted({max(q - 1 - gen.K, 0), q - 1}):
                count = gen.Q if tree.depth == 0 else 1
                s.q[b], s.ctx_start[b], s.ctx_count[b] = q, max(q - count, 0) if tree.depth == 0 else start, count
                engine.step(tree)
    engine.release(b)
