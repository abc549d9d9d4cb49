"""``peagle_jax.bench.hlo_reads``: the bytes a compiled step reads of each input, from the optimized HLO: a
slice or a gathered expert at the slice, any other use at the whole array, an in-place update at nothing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from test_mxfp4_packed import abstract_params, packed_config

from peagle_jax.bench.hlo_reads import array_bytes, input_reads, input_sizes
from peagle_jax.models import model as M


def _reads(f, *args):
    text = jax.jit(f).lower(*args).compile().as_text()
    return list(input_reads(text).values()), list(input_sizes(text).values())


def test_a_slice_reads_the_slice_and_a_product_the_whole_array():
    w = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    (w_read, _, _), (w_size, _, _) = _reads(lambda w, x, i: jax.lax.dynamic_slice(w, (i, 0), (2, 256)) @ x, w, x, i)
    assert (w_read, w_size) == (2 * 256 * 4, 64 * 256 * 4)
    (w_read, x_read), _ = _reads(lambda w, x: w @ x, w, x)
    assert (w_read, x_read) == (64 * 256 * 4, 256 * 4)


def test_an_update_in_place_reads_nothing_of_the_array():
    cache = jax.ShapeDtypeStruct((16, 1024), jnp.float32)
    row = jax.ShapeDtypeStruct((1, 1024), jnp.float32)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    f = jax.jit(lambda c, r, i: jax.lax.dynamic_update_slice(c, r, (i, 0)), donate_argnums=0)
    reads = input_reads(f.lower(cache, row, i).compile().as_text())
    assert list(reads.values())[:2] == [0, 1024 * 4]


def test_array_bytes_reads_hlo_shapes():
    assert array_bytes("u8[24,32,90,16]{3,2,1,0}") == 24 * 32 * 90 * 16
    assert array_bytes("bf16[3]") == 6 and array_bytes("(f32[2], s32[])") == 0


@pytest.mark.parametrize("dispatch", ["gather", "dense"])
def test_a_packed_decode_step_reads_only_the_selected_experts(dispatch):
    """GPT-OSS with MXFP4 experts held packed, one token: the gathered dispatch reads top_k of E experts'
    blocks and scales in every layer, the dense one all of them; the embedding the token's row; every other
    weight is read whole."""
    cfg = packed_config()
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch=dispatch))
    params = abstract_params(cfg)
    cache = jax.eval_shape(lambda: M.new_cache(cfg, 1, 64))
    tokens, start = jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    f = jax.jit(M.forward, static_argnames=("cfg",))
    text = f.lower(params, cache, tokens, start, cfg=cfg).compile().as_text()
    reads, sizes = input_reads(text), input_sizes(text)
    experts = [k for k in reads if "experts" in k and ("blocks" in k or "scales" in k)]
    assert len(experts) == 4 * len(cfg.moe.sparse_layers)
    share = cfg.moe.top_k / cfg.moe.num_experts if dispatch == "gather" else 1
    assert all(reads[k] == sizes[k] * share for k in experts)
    (embed,) = [k for k in reads if "embed_tokens" in k]
    row = sizes[embed] // cfg.vocab_size
    assert reads[embed] % row == 0 and reads[embed] < sizes[embed]  # the token's row (in each fusion taking it)
    weights = [k for k in reads if k.startswith("params") and "experts" not in k and k != embed]
    assert all(reads[k] >= sizes[k] for k in weights)
