"""What goes in and out of the serving engine (:class:`peagle_jax.serve.slots.SlotEngine`): a request
(:class:`SlotRequest`), the tokens it gains per step (:class:`SlotEvent`), and a busy slot (:class:`Slot`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

_ids = itertools.count(1)


def next_request_id() -> int:
    """A new request id (also used to name a request group)."""
    return next(_ids)


@dataclasses.dataclass
class SlotRequest:
    """One generation request: token ids in, at most ``max_new_tokens`` out, stopping after any of
    ``stop_token_ids`` (None: the model's EOS ids). ``group`` / ``group_size``: the choices of one API request
    with ``n`` > 1 (the same prompt, other seeds) share one prefill (:meth:`SlotEngine.admit`)."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: Sequence[int] | None = None
    group: int | None = None
    group_size: int = 1
    id: int = dataclasses.field(default_factory=next_request_id)
    echo: bool = False  # the admission's event also carries the prompt's log-probabilities (needs logprobs)
    # :mod:`peagle_jax.logit_rules` (need the engine's ``rules``): penalties over the tokens generated so far,
    # a bias added to the logits of token ids, and a grammar the answer follows (:meth:`Grammars.compile
    # <peagle_jax.grammar.Grammars.compile>`; needs the engine's ``grammars``)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    grammar: str | None = None

    @property
    def penalized(self) -> bool:
        """Whether the request changes the logits (penalties or a logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclasses.dataclass
class SlotEvent:
    """Tokens a request gained in one step; ``finish_reason`` is set on its last event: "stop" (a stop
    token, included in ``tokens``), "length" or "cancelled". With the engine's :attr:`SlotEngine.logprobs`,
    ``logprobs`` holds per token its raw log-probability and the top ones:
    (logprob, [(token id, logprob), ...]), most likely first (:func:`peagle_jax.logprobs.row_logprobs`)."""

    request: SlotRequest
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # An echo request's admission: the log-probabilities of its prompt tokens after the first, as ``logprobs``.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclasses.dataclass
class Slot:
    """A busy slot: its request, the request's stop ids and the tokens generated so far (to re-seed the
    drafter)."""

    request: SlotRequest
    stops: frozenset[int]
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far (to re-seed the drafter)

    @property
    def produced(self) -> int:
        return len(self.tokens)

    def gain(self, tokens) -> tuple[list[int], str | None]:
        """Take a step's tokens up to a stop token (included) or the request's length: (the tokens taken,
        the finish reason: "stop", "length" or None)."""
        out = []
        for tok in map(int, tokens):
            out.append(tok)
            self.tokens.append(tok)
            if tok in self.stops:
                return out, "stop"
            if self.produced >= self.request.max_new_tokens:
                return out, "length"
        return out, None
