"""The engine thread: a bounded queue, cancellation of waiting and running requests, and failures that end
one request (or the running ones) while the thread keeps serving."""

from __future__ import annotations

import queue

import jax
import pytest

from peagle_jax.engine.generator import Generator
from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig
from peagle_jax.serve.slots import SlotEngine, SlotRequest
from peagle_jax.serve.worker import EngineWorker, Failure, QueueFull

CFG = ModelConfig(
    family="llama",
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


class FlakyEngine(SlotEngine):
    """Fails the admission of prompts starting with 13 and the first step after ``fail_step`` is set."""

    fail_step = False

    def admit(self, req):
        if req.prompt[0] == 13:
            raise RuntimeError("boom in admit")
        if req.prompt[0] == 14:  # fails after the caches were donated to a device call
            for x in jax.tree.leaves(self.cache):
                x.delete()
            raise RuntimeError("boom after donation")
        return super().admit(req)

    def step(self):
        if self.fail_step:
            self.fail_step = False
            raise RuntimeError("boom in step")
        return super().step()


@pytest.fixture(scope="module")
def gen():
    return Generator(CFG, M.init_params(CFG, jax.random.key(0)), max_seq_len=64)


def _collect(worker, req, timeout=60):
    """Submit and wait for the request's last event; returns (tokens, finish reason or Failure)."""
    events: queue.Queue = queue.Queue()
    worker.submit(req, events.put)
    tokens = []
    while True:
        ev = events.get(timeout=timeout)
        if isinstance(ev, Failure):
            return tokens, ev
        tokens += ev.tokens
        if ev.finish_reason:
            return tokens, ev.finish_reason


def test_queue_is_bounded(gen):
    worker = EngineWorker(SlotEngine(gen, 1), max_queue=3)  # not started: nothing leaves the queue
    for _ in range(4):  # the first takes the free slot (once admitted), 3 wait
        worker.submit(SlotRequest([1], 4), lambda ev: None)
    with pytest.raises(QueueFull):
        worker.submit(SlotRequest([1], 4), lambda ev: None)
    assert worker.queue_depth == 4


def test_failures_end_one_request_and_the_thread_keeps_serving(gen):
    engine = FlakyEngine(gen, 2)
    worker = EngineWorker(engine, max_queue=8)
    worker.start(warmup=False)
    assert worker.ready.wait(30)
    ref = gen.generate([[1, 2, 3]], max_new_tokens=6, stop_token_ids=[])[0].token_ids
    assert _collect(worker, SlotRequest([1, 2, 3], 6, stop_token_ids=[])) == (ref, "length")
    tokens, failure = _collect(worker, SlotRequest([13, 2], 6, stop_token_ids=[]))
    assert isinstance(failure, Failure) and failure.status == 500 and tokens == []
    engine.fail_step = True
    tokens, failure = _collect(worker, SlotRequest([1, 2, 3], 6, stop_token_ids=[]))
    assert isinstance(failure, Failure) and failure.status == 500
    assert engine.active == 0
    assert _collect(worker, SlotRequest([1, 2, 3], 6, stop_token_ids=[])) == (ref, "length")
    # An invalid request that slipped past validation ends with a 400, not a crash.
    tokens, failure = _collect(worker, SlotRequest([99], 6))
    assert isinstance(failure, Failure) and failure.status == 400 and "vocabulary" in failure.message
    assert worker.alive


def test_cancel_frees_running_and_waiting_requests(gen):
    engine = SlotEngine(gen, 1)
    worker = EngineWorker(engine, max_queue=8)
    worker.start(warmup=False)
    assert worker.ready.wait(30)
    running: queue.Queue = queue.Queue()
    long = SlotRequest([1, 2], 60, stop_token_ids=[])
    waiting = SlotRequest([3], 60, stop_token_ids=[])
    worker.submit(long, running.put)
    running.get(timeout=30)  # it holds the only slot
    worker.submit(waiting, lambda ev: pytest.fail("a cancelled waiting request must never run"))
    worker.cancel(waiting.id)
    worker.cancel(long.id)
    # Both gone: a new request gets the slot and runs to its end.
    assert _collect(worker, SlotRequest([4], 3, stop_token_ids=[]))[1] == "length"
    assert worker.queue_depth == 0 and engine.active == 0


def test_a_failure_that_loses_the_caches_ends_the_running_requests(gen):
    """Driven synchronously (no thread), so that the order of events is fixed."""
    engine = FlakyEngine(gen, 2)
    worker = EngineWorker(engine)
    got = {}
    running = SlotRequest([1, 2, 3], 30, stop_token_ids=[])
    worker._admit(running, lambda ev: got.setdefault("running", []).append(ev))
    worker._step()
    assert engine.active == 1 and not engine.caches_lost()
    worker._admit(SlotRequest([14], 5), lambda ev: got.setdefault("bad", []).append(ev))
    assert isinstance(got["bad"][-1], Failure) and isinstance(got["running"][-1], Failure)
    assert engine.active == 0 and not engine.caches_lost()
    ok = SlotRequest([1, 2, 3], 4, stop_token_ids=[])
    worker._admit(ok, lambda ev: got.setdefault("ok", []).append(ev))
    while engine.active:
        worker._step()
    ref = gen.generate([[1, 2, 3]], max_new_tokens=4, stop_token_ids=[])[0].token_ids
    assert [t for ev in got["ok"] for t in ev.tokens] == ref and got["ok"][-1].finish_reason == "length"


class GrowingMaps:
    """A fake ``memory_maps``: every read adds ``per_read`` mappings, under a limit of ``limit``."""

    def __init__(self, per_read: int, limit: int = 65530):
        self.held, self.per_read, self.limit = 1000, per_read, limit

    def __call__(self):
        self.held += self.per_read
        return self.held, self.limit


def test_map_budget_projects_and_refuses_with_what_to_do():
    from peagle_jax.errors import UserError
    from peagle_jax.platform import MapBudget

    fits = MapBudget(100, "a small set", reader=GrowingMaps(500))
    for done in range(1, 101):
        fits.check(done)  # 1000 + 101 x 500 stays below 95% of 65530
    over = MapBudget(200, "a big set", reader=GrowingMaps(500))
    for done in range(1, 8):
        over.check(done)  # too few graphs yet to project from
    with pytest.raises(UserError, match=r"compiling the 200 graphs of a big set .*vm.max_map_count = 65,530.*sysctl"):
        over.check(8)  # 8 graphs took 4000: 200 would take about 100,000
    MapBudget(10**6, "no /proc", reader=lambda: None).check(5)  # not Linux: nothing to watch


def test_a_warmup_over_the_map_budget_fails_with_a_user_error(gen, monkeypatch):
    """The engine thread reports it as a user error (the server then exits with the message) instead of
    compiling until the process crashes."""
    import peagle_jax.platform

    monkeypatch.setattr(peagle_jax.platform, "memory_maps", GrowingMaps(20_000))
    worker = EngineWorker(SlotEngine(gen, 2), max_queue=4)
    worker.start()
    worker._thread.join(timeout=120)
    assert worker.user_error and not worker.ready.is_set()
    assert "memory mappings" in worker.failed and "--max-seq-len" in worker.failed
