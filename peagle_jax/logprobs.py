"""The target's raw log-probabilities of emitted tokens, computed inside the graphs that emit them.

Raw means the log-softmax of the target's float32 logits before temperature, top-k and top-p (vLLM's
default ``raw_logprobs``): the values do not depend on the sampling parameters, so a speculative step and a
plain step report the same numbers for the same token at the same prefix. A speculative step takes them
from the logits its verify already computed at the accepted path's nodes (the prefix of every emitted
token), never from an extra target pass.

Shapes are fixed: every emitted position carries its token's log-probability and the :data:`TOP_LOGPROBS`
most likely tokens (fewer only when the vocabulary is smaller), whatever a request asks for; the host
keeps as many as the request wants. The graphs compute them only under a static ``logprobs`` flag, so
the graphs of requests without log-probabilities stay as they were.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import executables
from peagle_jax.models import model

TOP_LOGPROBS = 20  # the most an OpenAI request may ask for (top_logprobs, completions logprobs)


class TokenLogprobs(NamedTuple):
    """For P positions per row (Z = min(:data:`TOP_LOGPROBS`, V)): ``logprob`` [B, P] of the token at each
    position, ``top_ids`` [B, P, Z] the most likely tokens there, most likely first (ties: lower id first),
    ``top_logprobs`` [B, P, Z] theirs."""

    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def token_logprobs(logits_BPV, tokens_BP) -> TokenLogprobs:
    """The raw log-probabilities of ``tokens`` under ``logits`` (one distribution per position)."""
    logp_BPV = jax.nn.log_softmax(logits_BPV.astype(jnp.float32), axis=-1)
    chosen_BP = jnp.take_along_axis(logp_BPV, tokens_BP[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top_BPZ, ids_BPZ = jax.lax.top_k(logp_BPV, min(TOP_LOGPROBS, logp_BPV.shape[-1]))
    return TokenLogprobs(chosen_BP, ids_BPZ.astype(jnp.int32), top_BPZ)


first_logprobs = executables.jit(token_logprobs)  # of a prefill's first token: logits [B, 1, V], tokens [B, 1]


def host_logprobs(lp: TokenLogprobs, P: int) -> TokenLogprobs:
    """A step's device log-probabilities [R, P'] on the host, padded to P positions (as its tokens)."""
    pad = P - lp.logprob.shape[1]
    return TokenLogprobs(*(np.pad(np.asarray(x), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in lp))


def row_logprobs(lp: TokenLogprobs, b: int, n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Row b's first n positions of host log-probabilities as (logprob, [(token id, logprob), ...])."""
    return [
        (float(lp.logprob[b, i]), list(zip(lp.top_ids[b, i].tolist(), lp.top_logprobs[b, i].tolist(), strict=True)))
        for i in range(n)
    ]


@functools.partial(executables.jit, static_argnames=("cfg", "window"), donate_argnames=("cache",))
def prefill_logprobs(params, cache, tokens_BT, lengths_B, start_B, next_B, *, cfg, window=None):
    """:func:`peagle_jax.models.model.prefill` for an echo with log-probabilities: the same cache writes and
    the same last-token output, plus the log-probabilities of the prompt's tokens from the logits at every
    position (the LM head over all T positions: only for requests that ask for them).

    Position t's logits predict token t + 1, so ``logprobs`` [B, T] holds at t those of the chunk's token
    t + 1, and at the last position those of ``next_B`` (the first token of the next chunk, of a prompt
    prefilled in chunks; anything for the last chunk, whose last row entries the caller drops). Returns
    ``(ForwardOut with logits [B, V] at each row's last prompt token, TokenLogprobs [B, T], cache)``.
    """
    out, cache = model.forward(params, cache, tokens_BT, start_B, cfg=cfg, window=window)
    targets_BT = jnp.concatenate([tokens_BT[:, 1:], next_B[:, None]], axis=1)
    lp = token_logprobs(out.logits, targets_BT)
    last_B1 = jnp.maximum(lengths_B - 1, 0).astype(jnp.int32)[:, None]
    last_BV = jnp.take_along_axis(out.logits, last_B1[:, :, None], axis=1)[:, 0]
    return model.ForwardOut(last_BV, out.aux, out.hidden), lp, cache
