"""Regeneration with continuous batching: the serving slot engine answering a whole shard of prompts.

:func:`peagle_jax.train.regen.regenerate` hands a generator a list of prompts at a time. The batch
:class:`~peagle_jax.engine.generator.Generator` decodes them in fixed batches, each running until its longest
answer ends, so the rows whose answers ended early idle. :class:`SlotGenerator` has the same ``generate``
method over a :class:`~peagle_jax.serve.slots.SlotEngine`: a prompt is admitted into a slot as soon as
one frees, so every step advances up to ``slots`` live answers. A row's tokens depend only on its own
prompt, sampling parameters and seed (the slot engine's invariant), so the shards do not depend on the
slot count or on which prompts share a step.
"""

from __future__ import annotations

from collections.abc import Sequence

from peagle_jax.engine.generator import GenerationResult, Generator


class SlotGenerator:
    """``generate(prompts, ...)`` answered by ``slots`` continuously batched rows of the target."""

    continuous = True  # regenerate() hands it a whole shard at once

    def __init__(self, cfg, params, *, slots: int, max_seq_len: int):
        from peagle_jax.serve.slots import SlotEngine

        self.engine = SlotEngine(Generator(cfg, params, max_seq_len=max_seq_len), slots)
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
        from peagle_jax.serve.slots import SlotRequest

        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(prompts)
        requests = [
            SlotRequest(list(p), max_new_tokens, temperature=temperature, seed=int(s), stop_token_ids=stop_token_ids)
            for p, s in zip(prompts, seeds, strict=True)
        ]
        order = {r.id: i for i, r in enumerate(requests)}
        tokens: list[list[int]] = [[] for _ in requests]
        results: list[GenerationResult | None] = [None] * len(requests)
        waiting = list(reversed(requests))  # popped from the end: admitted in order

        def take(events) -> None:
            for ev in events:
                i = order[ev.request.id]
                tokens[i].extend(ev.tokens)
                if ev.finish_reason is not None:
                    results[i] = GenerationResult(tokens[i], ev.finish_reason)
                    if on_answer is not None:
                        on_answer(i, results[i])

        engine = self.engine
        while waiting or engine.active:
            while waiting and engine.free:
                take([engine.admit(waiting.pop())])
            take(engine.step())
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:  # the engine's contract: every admitted request ends with a finish reason
            raise RuntimeError(f"the slot engine ended without answering prompts {missing[:5]}")
        return results
