"""Regeneration with continuous batching: the serving slot engine answering shard after shard of prompts.

:func:`peagle_jax.train.regen.regenerate` hands a batch generator a list of prompts at a time. The batch
:class:`~peagle_jax.engine.generator.Generator` decodes them in fixed batches, each running until its longest
answer ends, so the rows whose answers ended early idle. :class:`SlotGenerator` runs a
:class:`~peagle_jax.serve.slots.SlotEngine`: a prompt is admitted into a slot as soon as one frees, so every
step advances up to ``slots`` live answers; its ``stream_answers`` takes every remaining shard's prompts as one
stream, so that no slot idles at the end of a shard either. A row's tokens depend only on its own
prompt, sampling parameters and seed, so in fp32 the shards do not depend on the slot count or on which
prompts share a step (tested). In bf16 they may, rarely: a step's attention window covers its longest row,
so what shares a step sets how many masked slots a row's softmax and value products run over, and where
two tokens' logits nearly tie, the rounding can pick the other (so can a prefill padded to another bucket).

The engine's graphs are bucketed more finely than a server's (:func:`regen_buckets`): a regeneration runs for
hours over one fixed sequence budget, so a few more graphs to compile cost little against every prompt
padded less and every step attending over fewer slots.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from peagle_jax.engine.generator import GenerationResult, Generator

PREFILL_STEP = 32  # prefill buckets every 32 tokens (a server's double each time: 16, 32, 64, ...)
WINDOW_STEP = 64  # attention windows every 64 slots (a server's double each time: 128, 256, 512, ...)
# Together 1.07x the tokens/s of a server's buckets at the recipe's settings (docs/bench/regen/README.md).


def regen_buckets(max_seq_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prefill_buckets, window_buckets)`` of a regeneration over ``max_seq_len`` slots: prefill every
    :data:`PREFILL_STEP` tokens and then ``max_seq_len`` itself (the largest bucket is the prefill chunk, so
    the cache keeps ``max_seq_len`` slots), windows every :data:`WINDOW_STEP` slots below it (the generator
    adds the whole cache)."""
    prefill = (*range(PREFILL_STEP, max_seq_len, PREFILL_STEP), max_seq_len)
    return prefill, tuple(range(WINDOW_STEP, max_seq_len, WINDOW_STEP))


class SlotGenerator:
    """``generate(prompts, ...)`` answered by ``slots`` continuously batched rows of the target."""

    continuous = True  # regenerate() streams every missing shard's prompts through stream_answers

    def __init__(self, cfg, params, *, slots: int, max_seq_len: int, buckets: str = "regen"):
        """``buckets``: ``"regen"`` (:func:`regen_buckets`) or ``"serving"`` (the generator's defaults, as
        ``python -m peagle_jax.serve`` compiles them; ``python -m peagle_jax.bench.regen`` compares the two)."""
        from peagle_jax.serve.slots import SlotEngine

        if buckets not in ("regen", "serving"):
            raise ValueError(f"buckets must be 'regen' or 'serving', got {buckets!r}")
        kw = {}
        if buckets == "regen":
            kw["prefill_buckets"], kw["window_buckets"] = regen_buckets(max_seq_len)
        self.engine = SlotEngine(Generator(cfg, params, max_seq_len=max_seq_len, **kw), slots)
        self.cfg = cfg

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: Sequence[int] | int = 0,
        stop_token_ids: Sequence[int] | None = None,
        on_answer=None,
    ) -> list[GenerationResult]:
        """Each prompt's answer, in order; ``seed`` per prompt (a list) or one for all; ``on_answer(i, result)``
        is called as prompt i's answer ends (a progress bar, the caller's record of answers so far)."""
        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(prompts)
        results: list[GenerationResult | None] = [None] * len(prompts)

        def keep(i: int, result: GenerationResult) -> None:
            results[i] = result
            if on_answer is not None:
                on_answer(i, result)

        items = ((i, p, s) for i, (p, s) in enumerate(zip(prompts, seeds, strict=True)))
        self.stream_answers(
            items, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids, on_answer=keep
        )
        return results

    def stream_answers(
        self,
        items: Iterable[tuple[Hashable, Sequence[int], int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        stop_token_ids: Sequence[int] | None = None,
        on_answer,
    ) -> None:
        """Answer ``(key, prompt_ids, seed)`` items, taking the next from the iterator only as a slot frees, so
        that its prompts enter as earlier answers end and no slot idles until the iterator is spent;
        ``on_answer(key, result)`` as each answer ends. The regeneration feeds it one shard after another: the
        next shard's prompts fill the slots that the last answers of a shard leave."""
        from peagle_jax.serve.slots import SlotRequest

        keys: dict[int, Hashable] = {}
        tokens: dict[int, list[int]] = {}
        items = iter(items)

        def take(events) -> None:
            for ev in events:
                rid = ev.request.id
                tokens[rid].extend(ev.tokens)
                if ev.finish_reason is not None:
                    on_answer(keys.pop(rid), GenerationResult(tokens.pop(rid), ev.finish_reason))

        engine, spent = self.engine, False
        while True:
            while engine.free and not spent:
                item = next(items, None)
                if item is None:
                    spent = True
                    break
                key, prompt, seed = item
                req = SlotRequest(
                    list(prompt), max_new_tokens, temperature=temperature, seed=int(seed), stop_token_ids=stop_token_ids
                )
                keys[req.id], tokens[req.id] = key, []
                take([engine.admit(req)])
            if engine.active:
                take(engine.step())
            elif spent:
                break
        if keys:  # the engine's contract: every admitted request ends with a finish reason
            raise RuntimeError(f"the slot engine ended without answering {len(keys)} admitted prompts")
