"""Server metrics in the Prometheus text exposition format (``GET /metrics``), with no client library.

Counters and the step-time histogram are written by the engine thread and the HTTP handlers under one
lock; gauges (queue depth, active slots) and the speculative acceptance figures are read when rendered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from peagle_jax import executables
from peagle_jax.platform import compilation_cache_counts

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PREFIX = "peagle"


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.step_count = 0
        self.step_sum = 0.0
        self.step_buckets = [0] * len(STEP_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        # Set by the server: () -> value.
        self.queue_depth: Callable[[], int] = lambda: 0
        self.active_slots: Callable[[], int] = lambda: 0
        self.max_slots = 0
        # () -> (graphs compiled, graphs still to compile, seconds spent compiling).
        self.graphs: Callable[[], tuple[int, int, float]] = lambda: (0, 0, 0.0)
        self.spec_stats = None  # a SpecStats, when serving with a drafter
        self.steps_by_k: dict[int, int] | None = None  # speculative steps at each K (the engine's dict)
        self.lazy_drafter: Callable[[], tuple[int, int]] | None = None  # (unsynced admissions, re-seeds)
        # Requests with a grammar (structured outputs) and their rows' target forwards and emitted tokens: the
        # engine's dict {"requests", "target_forwards", "emitted"}.
        self.structured: dict[str, int] | None = None
        # The --load-k auto policy's step times: () -> {(busy-row bucket, K'): seconds}.
        self.policy_step_s: Callable[[], dict[tuple[int, int], float]] | None = None

    def request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            key = (endpoint, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1

    def tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def step(self, seconds: float) -> None:
        with self._lock:
            self.step_count += 1
            self.step_sum += seconds
            for i, edge in enumerate(STEP_BUCKETS):
                if seconds <= edge:
                    self.step_buckets[i] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def render(self) -> str:
        """The exposition text: ``# HELP`` / ``# TYPE`` then samples, one metric family at a time."""
        p = PREFIX
        out: list[str] = []

        def family(name, kind, help_text, samples):
            out.append(f"# HELP {p}_{name} {help_text}")
            out.append(f"# TYPE {p}_{name} {kind}")
            for suffix, labels, value in samples:
                lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                out.append(f"{p}_{name}{suffix}{lab} {value}")

        with self._lock:
            self._traffic(family)
        self._engine(family)
        if self.spec_stats is not None or self.structured is not None:
            self._speculation(family)
        return "\n".join(out) + "\n"

    def _traffic(self, family) -> None:
        """Requests, tokens, step times and time to first token (under the lock)."""
        family(
            "requests_total",
            "counter",
            "Requests by endpoint and outcome (ok, client_gone, bad_request, rejected, error).",
            [("", {"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(self.requests.items())],
        )
        family("prompt_tokens_total", "counter", "Prompt tokens.", [("", {}, self.prompt_tokens)])
        family("completion_tokens_total", "counter", "Tokens generated.", [("", {}, self.completion_tokens)])
        cumulative = [("_bucket", {"le": str(e)}, n) for e, n in zip(STEP_BUCKETS, self.step_buckets, strict=True)]
        family(
            "step_seconds",
            "histogram",
            "Wall time of one engine step over all active slots.",
            [
                *cumulative,
                ("_bucket", {"le": "+Inf"}, self.step_count),
                ("_sum", {}, f"{self.step_sum:.6f}"),
                ("_count", {}, self.step_count),
            ],
        )
        family(
            "time_to_first_token_seconds",
            "summary",
            "From admission to a slot until the first token (prefill).",
            [("_sum", {}, f"{self.ttft_sum:.6f}"), ("_count", {}, self.ttft_count)],
        )

    def _engine(self, family) -> None:
        """Queue, slots and compilation."""
        family("queue_depth", "gauge", "Requests waiting for a free slot.", [("", {}, self.queue_depth())])
        family("active_slots", "gauge", "Slots holding a request.", [("", {}, self.active_slots())])
        family("max_slots", "gauge", "Slots (--max-batch).", [("", {}, self.max_slots)])
        compiled, pending, compile_s = self.graphs()
        family("graphs_compiled", "gauge", "Warm-up graphs compiled so far.", [("", {}, compiled)])
        family(
            "graphs_pending",
            "gauge",
            "Warm-up graphs still to compile (in the background once /health is ready; --compile).",
            [("", {}, pending)],
        )
        seconds = [("", {}, f"{compile_s:.3f}")]
        family("compile_seconds", "gauge", "Seconds spent compiling the warm-up graphs so far.", seconds)
        counts = compilation_cache_counts()
        family(
            "compilation_cache_lookups_total",
            "counter",
            "Graphs found in the persistent compilation cache (hit) or compiled because they were not (miss).",
            [("", {"result": "hit"}, counts["hits"]), ("", {"result": "miss"}, counts["misses"])],
        )
        stored = executables.counts()
        family(
            "executables_total",
            "counter",
            "Executables of the decoding graphs loaded from the compilation cache's executable store without "
            "tracing (store), or traced and compiled, then stored (compiled).",
            [("", {"source": "store"}, stored["loaded"]), ("", {"source": "compiled"}, stored["compiled"])],
        )

    def _speculation(self, family) -> None:
        """Structured outputs and speculative decoding: acceptance, step lengths, the lazy drafter."""
        if self.structured is not None:
            family(
                "structured_requests_total",
                "counter",
                "Requests (choices) admitted with a grammar: response_format, structured_outputs, guided_*.",
                [("", {}, self.structured["requests"])],
            )
        spec = self.spec_stats
        if spec is not None and self.structured is not None:
            done = self.structured["target_forwards"]
            family(
                "structured_target_forwards_total",
                "counter",
                "Verify passes x live rows with a grammar (included in target_forwards_total).",
                [("", {}, done)],
            )
            family(
                "structured_acceptance_length",
                "gauge",
                "Tokens emitted per target forward (1 + accepted drafts) of the rows with a grammar.",
                [("", {}, f"{(self.structured['emitted'] / done if done else 0.0):.6f}")],
            )
        if spec is not None:
            forwards = spec.target_forwards
            family(
                "acceptance_length",
                "gauge",
                "Tokens emitted per target forward (1 + accepted drafts), over all requests.",
                [("", {}, f"{spec.acceptance_length:.6f}")],
            )
            family("target_forwards_total", "counter", "Verify passes x live rows.", [("", {}, forwards)])
            family(
                "speculative_steps_total",
                "counter",
                "Engine steps by the number of tokens drafted (0: a plain step; chosen by --load-k).",
                [("", {"k": str(k)}, n) for k, n in sorted(dict(self.steps_by_k or {}).items())],
            )
            family(
                "accepted_per_position_total",
                "counter",
                "Drafts accepted at each depth (1-based).",
                [("", {"position": str(k + 1)}, n) for k, n in enumerate(spec.accepted_per_position)],
            )
            if self.lazy_drafter is not None:
                unsynced, resyncs = self.lazy_drafter()
                family(
                    "unsynced_admissions_total",
                    "counter",
                    "Requests admitted without the drafter prefill, where drafting did not pay (--load-k auto).",
                    [("", {}, unsynced)],
                )
                family(
                    "drafter_resyncs_total",
                    "counter",
                    "Requests whose drafter context was re-seeded (a prefill) once drafting paid again.",
                    [("", {}, resyncs)],
                )
            if self.policy_step_s is not None:
                family(
                    "policy_step_seconds",
                    "gauge",
                    "The --load-k auto policy's step time per busy-row bucket and draft length K' (0: plain), "
                    "calibrated by the warm-up, then measured while serving: what it chooses K' by.",
                    [
                        ("", {"rows": str(r), "k": str(k)}, f"{t:.6f}")
                        for (r, k), t in sorted(self.policy_step_s().items())
                    ],
                )
            family(
                "acceptance_rate",
                "gauge",
                "Fraction of target forwards that accepted the draft at each depth.",
                [
                    ("", {"position": str(k + 1)}, f"{(n / forwards if forwards else 0.0):.6f}")
                    for k, n in enumerate(spec.accepted_per_position)
                ],
            )
