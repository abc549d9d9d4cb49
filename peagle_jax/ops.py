"""Stateless numerical building blocks shared by the target model and the drafter.

Shape letters: docs/glossary.md. Everything here is pure and jittable; nothing branches on
array values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.models.config import RopeConfig

# Large negative logit for masked attention scores. Finite, so a row that masks everything (a padding row)
# gives a uniform softmax instead of NaN.
MASK_VALUE = -1e30


# Most rows of x for which ``linear`` computes ``W @ x^T`` (see there).
SMALL_ROWS = 512

# The precision of every fp32 product on the decode path (up to ``SMALL_ROWS`` rows: decode, verify and draft
# steps): full fp32. A GPU's default runs fp32 products in TF32 (a TPU's in one bf16 pass), which rounds a
# decode step and a verify of the same token differently enough to flip greedy choices: on an NVIDIA H200,
# P-EAGLE's greedy output parted from plain decoding on some MT-Bench answers at the default precision and on
# none at this one. The CPU computes fp32 products in full precision either way. Larger products (prefill
# chunks, training batches) keep the backend's default.
EXACT = jax.lax.Precision.HIGHEST


def padded_rows(rows: int) -> int:
    """Rows ``linear`` multiplies for ``rows`` rows of x: the next power of two up to 16. XLA's CPU dot
    computing ``W @ x^T`` is fastest at 4, 8 and 16 columns (5 rows cost more than 8, 9 more than 16);
    beyond 16 padding costs more than it saves (``python -m peagle_jax.bench.linear``)."""
    return 1 << (rows - 1).bit_length() if 1 < rows <= 16 else rows


def linear(weight, x, in_axes: int = 1, preferred_element_type=None):
    """``x . W^T`` for ``W`` in Hugging Face ``[out..., in...]`` layout, contracting x's last ``in_axes`` axes.

    Computed as ``W @ x^T`` with W as the left operand, then transposed, for up to ``SMALL_ROWS`` rows of x
    (every decode, verify and draft step; prefill chunks): XLA's CPU dot then streams W in place. An
    optimization barrier keeps XLA from folding the transpose back into the product: as ``x @ W^T`` its CPU
    dot repacks all of W on every call once x has two rows or more, which made a verify of 2 tokens cost
    1.8x a 1-token decode step. Measured over SmolLM2's weights (``python -m peagle_jax.bench.linear``):
    ``W @ x^T`` takes 0.6-0.8x the time of ``x @ W^T`` at 2..64 rows, 0.4-0.9x at 96..512, 0.97x at 1024.
    Up to 16 rows, x is padded with zero rows to :func:`padded_rows`. A bf16 weight takes its own path (see
    the comment there: ``x @ W^T`` in bf16 with f32 accumulation, at least 4 rows). Beyond ``SMALL_ROWS``
    (training batches, long prefill chunks) the product is left to the compiler, which on TPU and GPU picks the
    layout itself; a bf16 one goes through :func:`einsum_f32` (bf16 operands, f32 accumulation, forward and
    gradient), since XLA's CPU computes a bf16 product with a bf16 result in f32.
    """
    out_shape = weight.shape[: weight.ndim - in_axes]
    n_in = math.prod(weight.shape[weight.ndim - in_axes :])
    lead = x.shape[: x.ndim - in_axes]
    w_OI, x_MI = weight.reshape(-1, n_in), x.reshape(-1, n_in)
    M = x_MI.shape[0]
    if M <= SMALL_ROWS and weight.dtype == jnp.bfloat16:
        # XLA's CPU library kernel for bf16 products takes ``x @ W^T`` with both operands in bf16 and f32
        # accumulation; for one row, or written as ``W @ x^T`` like below, XLA converts all of W to f32 on
        # every call first (5-15x slower; ``python -m peagle_jax.bench.linear --dtype bfloat16``). The barrier
        # keeps W an operand of the product rather than of a convert. At least 4 rows: from 3 rows on, a row's
        # result does not depend on the other rows (bit for bit; 2 rows round differently), so a decode step
        # and a verify compute the same products for the same row.
        Z = max(4, padded_rows(M))
        x_ZI = jnp.pad(x_MI.astype(weight.dtype), ((0, Z - M), (0, 0)))
        y_ZO = jax.lax.dot_general(
            x_ZI, jax.lax.optimization_barrier(w_OI), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        y_MO = y_ZO[:M].astype(preferred_element_type or x.dtype)
    elif M <= SMALL_ROWS:
        Z = padded_rows(M)
        x_ZI = jnp.pad(x_MI, ((0, Z - M), (0, 0)))
        y_OZ = jnp.dot(w_OI, x_ZI.T, precision=EXACT, preferred_element_type=preferred_element_type)
        y_MO = jax.lax.optimization_barrier(y_OZ).T[:M]
    elif weight.dtype == jnp.bfloat16:  # the bf16 kernel's form, f32 accumulation (see einsum_f32)
        y_MO = einsum_f32("MI,OI->MO", x_MI.astype(weight.dtype), w_OI).astype(preferred_element_type or x.dtype)
    else:
        y_MO = jnp.dot(x_MI, w_OI.T, preferred_element_type=preferred_element_type)
    return y_MO.reshape(*lead, *out_shape)


def _kernel_order(sx: str, sy: str, out: str) -> str:
    """x's indices (``sx``) in the order XLA's CPU bf16 kernel takes for the left operand of the product
    ``sx,sy->out``: batch indices first, then free ones, then summed ones (each group in x's order)."""
    return "".join(sorted(sx, key=lambda c: 0 if c in sy and c in out else 1 if c in out else 2))


def _split_factor(n: int) -> int | None:
    """A factor f of n with 1 < f < n (8, 4 or 2 if possible); None for 0, 1 and primes."""
    return next((f for f in (8, 4, 2, *range(3, math.isqrt(n) + 1)) if f < n and n % f == 0), None)


def _kept_transpose(x, sx: str, to: str, hi: str, lo: str):
    """``x`` (indices ``sx``) transposed to ``to`` as a copy that XLA keeps: the largest index that can be is
    split in two (named ``hi``, ``lo``) around the transpose. XLA folds a plain transpose of a product's operand
    or result into the product itself, which then loses the bf16 kernel's form; or None if no index splits."""
    splits = [(n, c, f) for c, n in zip(sx, x.shape, strict=True) if (f := _split_factor(n))]
    if not splits:
        return None
    n, c, f = max(splits)
    x = x.reshape([m for d, e in zip(sx, x.shape, strict=True) for m in ((n // f, f) if d == c else (e,))])
    sx2, to2 = sx.replace(c, hi + lo), to.replace(c, hi + lo)
    y = jnp.transpose(x, [sx2.index(d) for d in to2])
    return y.reshape([n if d == c else y.shape[to2.index(d)] for d in to])


def _product_bf16(spec: str, a, b):
    """``einsum(spec, a, b)`` of bf16 operands with an fp32 result, in the form XLA's CPU runs on its bf16
    kernel (YNNPACK): the left operand's indices in :func:`_kernel_order`, the result in the order the kernel
    writes it (batch, the left operand's free indices, the right's). Outside that form XLA converts both
    operands to f32 and computes the product in f32, 3-5x slower. The gradient products of a linear layer
    and of attention sum over the rows, which puts no operand in the form: the smaller one is copied into it
    (:func:`_kept_transpose`), and the result too where its order differs (at most weight-sized). Other
    backends (TPU, GPU) choose product layouts themselves: there the product is left as written."""
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    if jax.default_backend() != "cpu" or not any(c in sb and c not in out for c in sa):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    a_fits, b_fits = _kernel_order(sa, sb, out) == sa, _kernel_order(sb, sa, out) == sb
    if not a_fits and (b_fits or a.size > b.size):
        a, b, sa, sb = b, a, sb, sa
    plain = functools.partial(jnp.einsum, f"{sa},{sb}->{out}", a, b, preferred_element_type=jnp.float32)
    hi, lo = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in spec][:2]
    order = _kernel_order(sa, sb, out)
    if order != sa and (a := _kept_transpose(a, sa, order, hi, lo)) is None:
        return plain()  # no index splits (all extents 1 or prime): left to XLA
    natural = "".join(c for c in order if c in out) + "".join(c for c in sb if c in out and c not in sa)
    y = jnp.einsum(f"{order},{sb}->{natural}", a, b, preferred_element_type=jnp.float32)
    if natural == out:
        return y
    y = _kept_transpose(y, natural, out, hi, lo)
    return plain() if y is None else y


def _einsum_bf16_fwd(spec, a, b):
    return _product_bf16(spec, a, b), (a, b)


def _einsum_bf16_bwd(spec, res, g):
    a, b = res
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    g = g.astype(a.dtype)  # the cotangent of a bf16 computation, rounded as its value was
    da = _product_bf16(f"{out},{sb}->{sa}", g, b)
    db = _product_bf16(f"{out},{sa}->{sb}", g, a)
    return da.astype(a.dtype), db.astype(b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_bf16(spec, a, b):
    return _product_bf16(spec, a, b)


_einsum_bf16.defvjp(_einsum_bf16_fwd, _einsum_bf16_bwd)


def einsum_f32(spec: str, a, b):
    """``einsum(spec, a, b)`` with an fp32 result, for a product of two operands in which every index of an
    operand also appears in the other operand or in the output (no index summed out of one operand alone).

    With bf16 operands the product and both products of its gradient take bf16 operands and accumulate in
    f32, each laid out in the form XLA's CPU hands to its bf16 library kernel (YNNPACK; :func:`_product_bf16`);
    the cotangent is rounded to bf16 first, as the value it belongs to was. Left to autodiff, the gradient
    products would pair an f32 cotangent with a bf16 operand, which XLA computes in f32; and a bf16 product
    with a bf16 result is computed in f32 too (measured in a drafter training step: every product in f32, no
    faster than an fp32 step). Other dtypes: plain ``jnp.einsum`` with an fp32 result, autodiff as usual.
    """
    if a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16:
        return _einsum_bf16(spec, a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def swiglu(gate_up_BT2F):
    """``silu(gate) * up`` of gate and up stacked on axis -2 (``[..., 2, F]``), computed in the input's dtype.

    The gradient is written out, in fp32 from the bf16 values: ``d gate = dy * up * s * (1 + gate * (1 - s))``
    and ``d up = dy * silu(gate)`` with ``s = sigmoid(gate)``, stacked back as the input is. Left to
    autodiff, the bf16 backward rounds after each of its multiplies and builds the stacked gradient from two
    padded halves, which XLA's CPU runs as one unvectorised loop per layer."""
    return jax.nn.silu(gate_up_BT2F[..., 0, :]) * gate_up_BT2F[..., 1, :]


def _swiglu_fwd(gate_up_BT2F):
    return swiglu(gate_up_BT2F), gate_up_BT2F


def _swiglu_bwd(gate_up_BT2F, dy_BTF):
    gate, up = gate_up_BT2F[..., 0, :].astype(jnp.float32), gate_up_BT2F[..., 1, :].astype(jnp.float32)
    dy = dy_BTF.astype(jnp.float32)
    s = jax.nn.sigmoid(gate)
    d_gate, d_up = dy * up * s * (1.0 + gate * (1.0 - s)), dy * gate * s
    return (jnp.stack([d_gate, d_up], axis=-2).astype(gate_up_BT2F.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def rms_norm(x, weight, eps: float, scale_in_fp32: bool = False):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (the Hugging Face order of operations).
    ``scale_in_fp32`` (GPT-OSS): scale in fp32, then cast."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    weight = weight.reshape((1,) * (x.ndim - 1) + weight.shape)
    if scale_in_fp32:
        return (weight.astype(jnp.float32) * x32).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [H/2] in float32, including Llama 3.1 ``llama3`` low-frequency scaling and YaRN."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.type == "default":
        return inv_freq
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
    old_ctx = rope.original_max_position_embeddings
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, inv_freq: np.ndarray) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters``: frequencies rotating fewer than ``beta_slow`` times over the
    original context are interpolated (divided by ``factor``), those rotating more than ``beta_fast`` times
    kept, with a linear ramp between; ``truncate`` floors/ceils the ramp's ends."""

    def correction_dim(rotations: float) -> float:
        ctx = rope.original_max_position_embeddings
        return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp.astype(np.float32)
    pos_freqs = (
        np.float32(rope.theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
    ).astype(np.float32)
    interpolated = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def rope_scale(rope: RopeConfig) -> float:
    """The factor applied to the cos/sin tables: YaRN's attention factor (``0.1 ln(factor) + 1`` unless the
    config gives one), 1 otherwise."""
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0


def rope_cos_sin(positions_BT, inv_freq, scale: float = 1.0):
    """cos and sin tables [B, T, H] for the half-rotation layout used by Hugging Face Llama/Qwen (GPT-OSS's
    half-split rotation is the same), times ``scale`` (:func:`rope_scale`)."""
    freqs = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, H/2]
    emb_BTH = jnp.concatenate([freqs, freqs], axis=-1)
    if scale == 1.0:
        return jnp.cos(emb_BTH), jnp.sin(emb_BTH)
    return jnp.cos(emb_BTH) * scale, jnp.sin(emb_BTH) * scale


def apply_rope(x, cos_BTH, sin_BTH):
    """Rotate q or k ([B, T, N, H] or [B, T, G, H]) by their positions: ``x*cos + rotate_half(x)*sin``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos_BTH[:, :, None, :].astype(x.dtype)
    sin = sin_BTH[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def visible_mask(start_B, num_new: int, num_slots: int, mask_BTT=None):
    """Which cache slots each new query may attend to: a boolean [B, T, S].

    The cache holds row b's committed tokens in slots ``[0, start[b])`` and this call writes its T new
    tokens into slots ``[start[b], start[b] + T)``. Query t sees every committed slot, and among the new
    slots those that ``mask_BTT[b, t]`` allows (default: causal, ``t' <= t``). Slots at or beyond
    ``start[b] + T`` hold stale or placeholder entries from earlier calls and are never visible, which is
    why rejected or padded rows can be left in the cache and simply overwritten later.
    """
    slots_S = jnp.arange(num_slots, dtype=jnp.int32)
    rel_BS = slots_S[None, :] - start_B[:, None]
    committed_B1S = (rel_BS < 0)[:, None, :]
    if mask_BTT is None:
        t_T1 = jnp.arange(num_new, dtype=jnp.int32)[:, None]
        return committed_B1S | ((rel_BS[:, None, :] >= 0) & (rel_BS[:, None, :] <= t_T1[None]))
    in_new_BS = (rel_BS >= 0) & (rel_BS < num_new)
    idx_BTS = jnp.broadcast_to(jnp.clip(rel_BS, 0, num_new - 1)[:, None, :], (*mask_BTT.shape[:2], num_slots))
    among_new_BTS = jnp.take_along_axis(mask_BTT.astype(bool), idx_BTS, axis=2)
    return committed_B1S | (in_new_BS[:, None, :] & among_new_BTS)


def new_token_layout(start_B, num_new: int, num_slots: int, window: int | None, mask_BTT=None, positions_BT=None):
    """What a forward over T new tokens per row needs: int32 starts, RoPE positions (default: the write
    slots ``start .. start+T-1``) and the [B, T, W] visibility over the attention window W (a static bucket,
    at most the cache size)."""
    start_B = start_B.astype(jnp.int32)
    if positions_BT is None:
        positions_BT = start_B[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]
    width = min(window or num_slots, num_slots)
    return start_B, positions_BT, visible_mask(start_B, num_new, width, mask_BTT)


def sliding_visible(visible_BTW, start_B, positions_BT, window: int):
    """``visible_BTW`` narrowed to a sliding window: a key is visible when ``query position - key position <
    window`` (transformers' sliding mask). A committed key's position is its slot (committed tokens sit at
    slot = position; tree compaction keeps that), a new key's is its RoPE position, so a tree's nodes are
    judged by their path positions, not by the slots they occupy during verification."""
    B, T, W = visible_BTW.shape
    slots_W = jnp.arange(W, dtype=jnp.int32)
    rel_BW = slots_W[None, :] - start_B[:, None]
    new_pos_BW = jnp.take_along_axis(positions_BT.astype(jnp.int32), jnp.clip(rel_BW, 0, T - 1), axis=1)
    key_pos_BW = jnp.where(rel_BW >= 0, new_pos_BW, slots_W[None, :])
    return visible_BTW & (positions_BT[:, :, None] - key_pos_BW[:, None, :] < window)


BF16_FORMS = ("bf16 K @ q^T", "bf16 q @ K^T")  # the forms of attention() for XLA's CPU bf16 kernel


def attention_form(rows: int, dtype=jnp.float32) -> str:
    """How :func:`attention` computes the scores for ``rows`` query rows per kv head (M = J*T) over a cache of
    ``dtype``: up to ``SMALL_ROWS`` (every decode, verify and draft step) ``"K @ q^T"``, or for a bf16
    cache ``"bf16 K @ q^T"``; beyond (prefill chunks) ``"q @ K^T"``."""
    if rows > SMALL_ROWS:
        return "q @ K^T"
    return "bf16 K @ q^T" if jnp.dtype(dtype) == jnp.bfloat16 else "K @ q^T"


def attention(q_BTNH, k_BGSH, v_BGSH, visible_BTS, form: str | None = None, sinks_N=None):
    """Grouped-query attention of T new queries over S cache slots; softmax in fp32.

    ``sinks_N`` (GPT-OSS): one learned logit per query head that joins each softmax denominator, unscaled and
    max-subtracted together with the scores, and takes no value.

    The J query heads sharing a kv head are folded into the matmul rows (``[M, H] x [S, H]`` with M = J*T, per
    row and kv head), so the cache is read once per kv head. S is the slots given: the caller passes the
    window W of the cache it attends over.

    ``form`` (default :func:`attention_form`) is how the products are computed. ``"K @ q^T"``: the keys are
    the left operand of the scores, and the product is transposed behind an optimization barrier, as
    :func:`linear` does with its weights: as ``q @ K^T``, XLA's CPU dot repacks the whole key window on every
    call. ``"bf16 K @ q^T"``: the same with bf16 operands and f32 accumulation, the query rows padded to at
    least 4 (a row's scores then do not depend on the other rows), and ``probs @ V`` with the same rows: the
    forms in which XLA's CPU library kernel multiplies bf16 operands (see :func:`linear`); otherwise it
    converts the key and value windows to f32 first. ``"bf16 q @ K^T"`` (kept for the benchmark) is the
    kernel's other form for the scores, ``q @ K^T`` with the keys behind a barrier, which repacks each row's
    key window and takes about twice as long. Measured over SmolLM2's 30 layers
    (``python -m peagle_jax.bench.attention``, docs/bench/attention/README.md).
    """
    from peagle_jax import chain_attention as chain  # imported here: that module builds on this one

    if isinstance(visible_BTS, chain.ChainVisibility):
        return chain.chain_attention(q_BTNH, k_BGSH, v_BGSH, visible_BTS)
    B, T, N, H = q_BTNH.shape
    G = k_BGSH.shape[1]
    J = N // G
    q_BGJTH = jnp.transpose(q_BTNH.reshape(B, T, G, J, H), (0, 2, 3, 1, 4))
    M = J * T
    form = form or attention_form(M, k_BGSH.dtype)
    if form == "K @ q^T":
        q_BGMH = q_BGJTH.reshape(B, G, M, H)
        scores_BGSM = jnp.einsum("BGSH,BGMH->BGSM", k_BGSH, q_BGMH, precision=EXACT, preferred_element_type=jnp.float32)
        scores_BGJTS = jnp.swapaxes(jax.lax.optimization_barrier(scores_BGSM), -1, -2).reshape(*q_BGJTH.shape[:4], -1)
    elif form in BF16_FORMS:
        Z = max(4, padded_rows(M))
        q_BGZH = jnp.pad(q_BGJTH.reshape(B, G, M, H).astype(k_BGSH.dtype), ((0, 0), (0, 0), (0, Z - M), (0, 0)))
        dims = (((3,), (3,)), ((0, 1), (0, 1)))
        if form == "bf16 K @ q^T":
            scores_BGSZ = jax.lax.dot_general(k_BGSH, q_BGZH, dims, preferred_element_type=jnp.float32)
            scores_BGZS = jnp.swapaxes(jax.lax.optimization_barrier(scores_BGSZ), -1, -2)
        else:
            k_BGSH = jax.lax.optimization_barrier(k_BGSH)
            scores_BGZS = jax.lax.dot_general(q_BGZH, k_BGSH, dims, preferred_element_type=jnp.float32)
        scores_BGJTS = scores_BGZS[:, :, :M].reshape(*q_BGJTH.shape[:4], -1)
    elif form == "q @ K^T":
        scores_BGJTS = jnp.einsum("BGJTH,BGSH->BGJTS", q_BGJTH, k_BGSH, preferred_element_type=jnp.float32)
    else:
        raise ValueError(f"unknown attention form {form!r}")
    scores_BGJTS = scores_BGJTS * (1.0 / math.sqrt(H))
    scores_BGJTS = jnp.where(visible_BTS[:, None, None, :, :], scores_BGJTS, MASK_VALUE)
    if sinks_N is None:
        probs_BGJTS = jax.nn.softmax(scores_BGJTS, axis=-1).astype(v_BGSH.dtype)
    else:  # head n = g * J + j, as q_BGJTH splits it
        sink_BGJT1 = jnp.broadcast_to(sinks_N.astype(jnp.float32).reshape(1, G, J, 1, 1), (*scores_BGJTS.shape[:4], 1))
        with_sink = jnp.concatenate([scores_BGJTS, sink_BGJT1], axis=-1)
        probs_BGJTS = jax.nn.softmax(with_sink, axis=-1)[..., :-1].astype(v_BGSH.dtype)
    if form in BF16_FORMS:  # the same kernel for probs @ V: rows padded, f32 accumulation
        probs_BGZS = jnp.pad(probs_BGJTS.reshape(B, G, M, -1), ((0, 0), (0, 0), (0, Z - M), (0, 0)))
        dims = (((3,), (2,)), ((0, 1), (0, 1)))
        out_BGZH = jax.lax.dot_general(probs_BGZS, v_BGSH, dims, preferred_element_type=jnp.float32)
        out_BGJTH = out_BGZH[:, :, :M].astype(v_BGSH.dtype).reshape(*q_BGJTH.shape)
    else:
        precision = EXACT if M <= SMALL_ROWS else None
        out_BGJTH = jnp.einsum("BGJTS,BGSH->BGJTH", probs_BGJTS, v_BGSH, precision=precision)
    return jnp.transpose(out_BGJTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H)


def argmax_first(x, axis: int = -1):
    """Index of the first maximum, as max + compare + min-index.

    Same result as ``jnp.argmax``, but lowers to two plain reductions instead of a variadic (value, index)
    reduction, which Neuron runs badly over a large vocabulary.
    """
    n = x.shape[axis]
    best = jnp.max(x, axis=axis, keepdims=True)
    shape = [1] * x.ndim
    shape[axis] = n
    idx = jnp.arange(n, dtype=jnp.int32).reshape(shape)
    return jnp.min(jnp.where(x == best, idx, n), axis=axis).astype(jnp.int32)
