"""Plain (non-speculative) batched generation: bucketed prefill, one jitted decode step, a host loop.

Every device call has a fixed shape: the batch is padded to a batch bucket, prompts to a length bucket,
and the decode step always sees ``[B]`` tokens at per-row positions. Attention reads only a window of the
cache whose width is also bucketed (:data:`WINDOW_BUCKETS`), so its cost follows the context. A run thus
compiles at most one prefill per (batch, length, window) bucket and one decode step per (batch, window)
bucket, whatever the prompts are.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import executables
from peagle_jax.engine.buckets import BATCH_BUCKETS, ONE_ROW_PAD, PREFILL_BUCKETS, WINDOW_BUCKETS, bucket
from peagle_jax.engine.overlap import Launched, StepLoop
from peagle_jax.engine.state import RowState, host_copy
from peagle_jax.errors import UserError
from peagle_jax.logprobs import prefill_logprobs, token_logprobs
from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.sampling import SamplingParams, greedy_graph, sample
from peagle_jax.spec.plan import Windows, step_keys, windows_between
from peagle_jax.spec.tree import chain


class RequestError(UserError):
    """A request that cannot be served as given (too long, empty, ...); the message says why."""


@functools.partial(
    executables.jit, static_argnames=("cfg", "greedy_only", "window", "logprobs"), donate_argnames=("cache",)
)
def decode_step(
    params,
    cache,
    tokens_B,
    positions_B,
    seeds_B,
    sampling: SamplingParams,
    *,
    cfg,
    greedy_only,
    window,
    logprobs=False,
    rules=None,
):
    """Feed one token per row at its position, sample the next. Returns (next tokens [B], cache), and with
    ``logprobs`` (static) (next tokens [B], cache, :class:`~peagle_jax.logprobs.TokenLogprobs` [B, 1] of the
    next tokens). ``rules``: :class:`peagle_jax.logit_rules.LogitRules` of the rows (None: none)."""
    out, cache = model.forward(params, cache, tokens_B[:, None], positions_B, cfg=cfg, window=window)
    next_B = sample(out.logits[:, 0], sampling, seeds_B, positions_B + 1, greedy_only=greedy_only, rules=rules)
    if not logprobs:
        return next_B, cache
    return next_B, cache, token_logprobs(out.logits, next_B[:, None])


@functools.partial(executables.jit, static_argnames=("greedy_only",))
def sample_jit(logits_BV, sampling, seeds_B, positions_B, *, greedy_only, rules=None):
    return sample(logits_BV, sampling, seeds_B, positions_B, greedy_only=greedy_only, rules=rules)


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS/stop token) or "length"


@dataclasses.dataclass
class StepStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    new_tokens: int = 0


class Generator:
    """Batched plain decoding for one target model, holding its compiled graphs between calls."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        *,
        max_seq_len: int = 2048,
        prefill_buckets: Sequence[int] = PREFILL_BUCKETS,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        slack: int = 0,
        mesh=None,
        window_buckets: Sequence[int] | None = None,
    ):
        """``mesh`` (a :func:`peagle_jax.sharding.make_mesh` mesh) runs tensor-parallel: the parameters and
        every KV cache are placed sharded on it, and jit partitions the graphs. ``window_buckets``: the
        attention windows below the whole cache that steps attend over (default :data:`WINDOW_BUCKETS`;
        empty: every step attends over the whole cache); each is a graph per step kind, so fewer windows
        compile fewer graphs and make a short context's steps attend over more slots."""
        if max_seq_len < 2:
            raise RequestError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.mesh = mesh
        if mesh is not None and params is not None:
            from peagle_jax import sharding

            params = sharding.shard_target(cfg, params, mesh)  # keeps an expert split already placed
        self.cfg, self.params, self.max_seq_len = cfg, params, max_seq_len
        self.prefill_buckets = tuple(b for b in sorted(prefill_buckets) if b <= max_seq_len) or (max_seq_len,)
        self.batch_buckets = tuple(sorted(batch_buckets))
        # Cache slots: max_seq_len rounded up to whole prefill chunks, so that a padded last chunk still
        # fits (the cache write requires start + T <= S for every row), and at least max_seq_len + ``slack``
        # (the slots a multi-token step may write past the last committed token). The slack is not rounded
        # up to another chunk, and the top window bucket is the whole cache: a speculative generator with
        # max_seq_len 2048 has 2063 slots and windows 128 .. 1024, 2063, not 4096 slots and a 4096 window
        # (half the cache memory, and one window's graphs fewer to compile).
        chunk = self.prefill_buckets[-1]
        self.num_slots = max(-(-max_seq_len // chunk) * chunk, max_seq_len + slack)
        below = WINDOW_BUCKETS if window_buckets is None else sorted(set(window_buckets))
        self.window_buckets = tuple(w for w in below if w < max_seq_len) + (self.num_slots,)
        self.windows = Windows(self.window_buckets)  # every graph's attention window (spec.plan)
        self.stats = StepStats()
        # Whether the serving engine's steps also return the emitted tokens' raw log-probabilities (a static
        # flag of the step graphs: :mod:`peagle_jax.logprobs`); the batch generators leave it off.
        self.logprobs = False

    def twin(self) -> Generator:
        """The same model and graphs with statistics of its own (a serving engine's shadow)."""
        twin = copy.copy(self)
        twin.stats = StepStats()
        return twin

    def reset_statistics(self) -> None:
        """Zero the counters of the speculative steps, in place (others hold them): none here."""

    def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Raise :class:`RequestError` when these prompts cannot be generated from (empty, too long, ids
        outside the vocabulary, more than the largest batch bucket)."""
        if not prompts:
            raise RequestError("no prompts given")
        if len(prompts) > self.batch_buckets[-1]:
            raise RequestError(f"{len(prompts)} prompts exceed the largest batch bucket {self.batch_buckets[-1]}")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise RequestError(f"prompt {i} is empty")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise RequestError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                    f"max_seq_len={self.max_seq_len}"
                )
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt {i} has token id {bad[0]} outside the vocabulary 0..{self.cfg.vocab_size - 1}"
                )

    def window(self, context: int) -> int:
        """The attention window bucket covering ``context`` slots."""
        return self.windows.of(context)

    def cache_slots(self, batch: int) -> int:
        """Slots of a fresh cache of ``batch`` rows: :attr:`num_slots`, plus :data:`ONE_ROW_PAD` for one fp32
        row on the CPU backend, so that even the top window is a slice of that cache (see there)."""
        padded = batch == 1 and self.cfg.jnp_dtype == jnp.float32 and jax.default_backend() == "cpu"
        return self.num_slots + (ONE_ROW_PAD if padded else 0)

    def prefill(self, prompts: Sequence[Sequence[int]], batch: int, on_chunk=None, on_logprobs=None):
        """Prefill prompts (padded to ``batch`` rows) into a fresh cache; long prompts go in chunks of the
        largest bucket. ``on_chunk(out, start, T)`` sees each chunk's output (the speculative generator
        seeds its drafter from the aux hidden states). With ``on_logprobs(lp, start, T)`` the chunks run
        :func:`peagle_jax.logprobs.prefill_logprobs` (an echo's prompt log-probabilities: the same cache and
        last logits) and it sees each chunk's log-probabilities [batch, T] (at t: those of prompt token
        start + t + 1). Returns (last-token logits [batch, V], cache)."""
        cache = model.new_cache(self.cfg, batch, self.cache_slots(batch))
        if self.mesh is not None:
            from peagle_jax.sharding import shard_cache

            cache = shard_cache(cache, self.mesh)
        lengths = np.array([len(p) for p in prompts] + [1] * (batch - len(prompts)), np.int32)
        chunk = self.prefill_buckets[-1]
        logits = None
        for start in range(0, int(lengths.max()), chunk):
            T = bucket(min(int(lengths.max()) - start, chunk), self.prefill_buckets)
            tokens = np.zeros((batch, T), np.int32)
            for b, p in enumerate(prompts):
                piece = p[start : start + T]
                tokens[b, : len(piece)] = piece
            n_B = np.clip(lengths - start, 0, T)
            # Rows whose prompt ended in an earlier chunk re-write their own stale tail: harmless, and
            # their last logits are kept from the chunk where they ended.
            args = (
                self.params,
                cache,
                jnp.asarray(tokens),
                jnp.asarray(np.maximum(n_B, 1)),
                jnp.full((batch,), start, jnp.int32),
            )
            if on_logprobs is None:
                out, cache = model.prefill(*args, cfg=self.cfg, window=self.windows.prefill_window(start, T))
            else:
                after = [p[start + T] if start + T < len(p) else 0 for p in prompts] + [0] * (batch - len(prompts))
                out, lp, cache = prefill_logprobs(
                    *args, jnp.asarray(after, jnp.int32), cfg=self.cfg, window=self.windows.prefill_window(start, T)
                )
                on_logprobs(lp, start, T)
            if on_chunk is not None:
                on_chunk(out, start, T)
            ended_here = jnp.asarray((lengths > start) & (lengths <= start + T))[:, None]
            logits = out.logits if logits is None else jnp.where(ended_here, out.logits, logits)
        return logits, cache

    def launch_plain(
        self,
        cache,
        dcache,
        state: RowState,
        seeds,
        sampling,
        greedy_only: bool,
        live,
        root=None,
        lazy=False,
        rules=None,
    ) -> tuple[Launched, object, object]:
        """Launch a plain step over the first R = ``len(live)`` rows of ``state`` without waiting for it (the
        serving engine's step; :meth:`RowState.advance_plain` moves the rows on). ``root`` [R] (on the device):
        the tokens to feed, e.g. the unread output of the previous plain step; by default the host's roots.
        ``rules``: the rows' :class:`~peagle_jax.logit_rules.LogitRules`. ``dcache`` (no drafter: None) and
        ``lazy`` are the speculative generator's (:meth:`peagle_jax.spec.stepper.SpecStepper.launch_plain`).
        Returns (the launched step, cache, dcache)."""
        t0, R = time.perf_counter(), len(live)
        next_R, cache, *lp = decode_step(
            self.params,
            cache,
            host_copy(state.root[:R]) if root is None else root,
            host_copy(state.q[:R]),  # copies: the host state moves on at once, maybe while the step reads it
            seeds,
            sampling,
            cfg=self.cfg,
            greedy_only=greedy_only,
            window=self.windows.plain_window(state.q[:R][live]),
            logprobs=self.logprobs,
            rules=rules,
        )
        at = state.advance_plain(live)
        self.stats.decode_steps += 1
        return Launched(next_R, np.array(live, bool), t0, at=at, logprobs=lp[0] if lp else None), cache, dcache

    def read_plain(self, launched: Launched, state: RowState, valid, t_last_read: float, next_R=None) -> np.ndarray:
        """Read a launched plain step's tokens [R] (unless already read: ``next_R``) and commit them for the
        ``valid`` rows (those still holding the request they held at launch); its device time since
        ``t_last_read`` goes to the statistics (:meth:`_plain_seconds`)."""
        next_R = np.asarray(launched.tokens) if next_R is None else next_R
        state.commit_plain(next_R, launched.at, valid)
        self._plain_seconds(launched.device_seconds(t_last_read, time.perf_counter()))
        return next_R

    def _plain_seconds(self, seconds: float) -> None:
        self.stats.decode_s += seconds

    def needs_flush(self, state: RowState, rows: int, full: int | None = None, lazy: bool = False) -> bool:
        """Whether a plain step would first write queued drafter context: never without a drafter."""
        return False

    def _request(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids):
        """Check a request and lay out its per-row arrays over the batch bucket: (n, B, stop ids, sampling
        params, whether every row is greedy, seeds)."""
        self.check_request(prompts, max_new_tokens)
        n = len(prompts)
        B = bucket(n, self.batch_buckets)
        stops = set(self.cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)

        def per_row(x, dtype):
            arr = np.broadcast_to(np.asarray(x, dtype), (n,))
            return np.concatenate([arr, np.zeros(B - n, dtype)])

        sampling = SamplingParams.make(
            B, per_row(temperature, np.float32), per_row(top_k, np.int32), per_row(top_p, np.float32)
        )
        greedy_only = greedy_graph(sampling.temperature)
        return n, B, stops, sampling, greedy_only, jnp.asarray(per_row(seed, np.uint32))

    @staticmethod
    def _emit(b, toks, gained, produced, done, stops, max_new_tokens):
        """Append row b's new tokens to ``gained[b]`` until a stop token or ``max_new_tokens``."""
        for tok in toks:
            if done[b]:
                return
            gained[b].append(tok)
            produced[b] += 1
            if tok in stops or produced[b] >= max_new_tokens:
                done[b] = True

    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int, *, greedy_only: bool = True) -> float:
        """Compile, by running once on scratch inputs, every graph a request of this size will use: the
        prefill buckets of the prompt and a decode step for each attention window its context crosses.
        Returns the seconds spent."""
        t0 = time.perf_counter()
        greedy_only = greedy_graph(0.0 if greedy_only else 1.0)  # the graphs such requests call
        B = bucket(batch, self.batch_buckets)
        logits, cache = self.prefill([[0] * prompt_len] * B, B)
        sampling = SamplingParams.make(B)
        seeds = jnp.zeros(B, jnp.uint32)
        # The first token comes from the same graph as in :meth:`stream` (so its placement matches too: with a
        # mesh, a token array placed differently would compile the decode step again).
        tokens = sample_jit(logits, sampling, seeds, jnp.full(B, prompt_len, jnp.int32), greedy_only=greedy_only)
        windows = windows_between(self.window_buckets, prompt_len + 1, prompt_len + max_new_tokens)
        for key in step_keys([B], [chain(0)], windows, [greedy_only]):
            pos = jnp.full(B, self.windows.plain_q(key.window), jnp.int32)
            tokens, cache = decode_step(
                self.params,
                cache,
                tokens,
                pos,
                seeds,
                sampling,
                cfg=self.cfg,
                greedy_only=greedy_only,
                window=key.window,
            )
        jax.block_until_ready(tokens)
        return time.perf_counter() - t0

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 128,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> Iterator[list[list[int]]]:
        """Yield, after each step, the tokens each prompt gained in that step (a list per prompt).

        Sampling arguments are scalars or per-prompt sequences. A row that hits a stop token or its
        ``max_new_tokens`` stops gaining tokens while the others go on (it keeps stepping, padded).
        """
        n, B, stops, sampling, greedy_only, seeds = self._request(
            prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids
        )
        t0 = time.perf_counter()
        logits, cache = self.prefill(prompts, B)
        positions = np.array([len(p) for p in prompts] + [0] * (B - n), np.int32)
        first = sample_jit(logits, sampling, seeds, jnp.asarray(positions), greedy_only=greedy_only)
        jax.block_until_ready(first)
        self.stats.prefill_s += time.perf_counter() - t0
        done = np.zeros(B, bool)
        done[n:] = True
        loop = StepLoop(Launched(first, ~done))  # the prefill's first tokens: read like a step's
        produced = np.zeros(B, np.int32)
        t_loop, t_caller = time.perf_counter(), 0.0

        def launch(tokens_B) -> Launched:
            # Finished rows keep feeding a token at a clamped position; their writes land past their output
            # and are never read.
            nonlocal cache
            live = ~done
            next_B, cache = decode_step(
                self.params,
                cache,
                tokens_B,
                jnp.asarray(np.minimum(positions, self.num_slots - 1)),
                seeds,
                sampling,
                cfg=self.cfg,
                greedy_only=greedy_only,
                window=self.windows.plain_window(positions[live]),
            )
            positions[:] += 1
            self.stats.decode_steps += 1
            return Launched(next_B, live)

        def following(pending: Launched):
            return launch if np.any(~done & (produced + 1 < max_new_tokens)) else None

        while True:
            # The next step is launched before this step's tokens are read (engine.overlap). It is skipped
            # when every live row is about to reach max_new_tokens; when all rows stop on a stop token
            # instead, its result is dropped.
            # (The loop always holds a launched step: choose and run, for a step launched afresh, never run.)
            tokens_host = loop.turn(None, None, None, following).tokens
            gained = [[] for _ in range(n)]
            for b in range(n):
                self._emit(b, [int(tokens_host[b])], gained, produced, done, stops, max_new_tokens)
            self.stats.new_tokens += sum(len(g) for g in gained)
            t_yield = time.perf_counter()
            yield gained
            t_caller += time.perf_counter() - t_yield
            if done.all():
                self.stats.decode_s += time.perf_counter() - t_loop - t_caller
                return

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list[GenerationResult]:
        """Run :meth:`stream` to the end; one :class:`GenerationResult` per prompt."""
        out: list[list[int]] = [[] for _ in prompts]
        for gained in self.stream(prompts, **kwargs):
            for b, toks in enumerate(gained):
                out[b].extend(toks)
        stops = set(self.cfg.eos_token_ids if kwargs.get("stop_token_ids") is None else kwargs["stop_token_ids"])
        return [GenerationResult(t, "stop" if t and t[-1] in stops else "length") for t in out]
