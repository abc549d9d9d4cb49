"""Unpacking MXFP4 expert weights inside a graph: the packed experts of :mod:`peagle_jax.models.moe`.

A packed matrix is a pair of uint8 arrays in our parameter layout (:mod:`peagle_jax.models.weights` moves
the hub's bytes there at load, losslessly): ``blocks`` [..., C/32, 16] and ``scales`` [..., C/32], where
the matrix is [..., C] and the last axis is the one the products contract (D for ``gate_up_proj`` [E, 2, F,
D], F for ``down_proj`` [E, D, F]). Byte j of block g holds elements ``32 g + 2 j`` (low nibble) and
``32 g + 2 j + 1`` (high nibble), each an FP4 E2M1 code; block g's value is ``code value * 2**(scale - 127)``.

:func:`unpack` returns that matrix in ``dtype``, with these invariants:

- every value is bit for bit what transformers' dequantization gives (``ldexp`` in float32, then a cast;
  :mod:`peagle_jax.models.mxfp4`, the numpy reference): signed zeros, float32 subnormals (scales 0 and 1),
  and ``+-inf`` from ``2**128`` up (scales 253..255, never NaN) included. bfloat16 is exact too: every value
  has at most two significant bits, within bfloat16's exponent range;
- it is built from integer bit operations and one bitcast, with no floating-point arithmetic, so a backend
  that flushes float32 subnormals to zero (XLA:CPU does) cannot change a value before the products read it;
- it is elementwise over the leading axes and the blocks (no gather, no ``lax.cond``, nothing data
  dependent); a caller unpacks a sliced expert (``gather`` dispatch: the call reads that expert's 4.25 bits
  per weight) or every expert (``dense``), and an axis split over devices stays split: the trailing
  [C/32, 32] -> [C] merge keeps a split of the block axis as a split of C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK_SIZE = 32  # values per scale
BYTES_PER_BLOCK = BLOCK_SIZE // 2
E8M0_BIAS = 127
_F32_INF = 0x7F800000
_F32_MANTISSA_BITS = 23


def packed_shapes(rows: tuple[int, ...], cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(blocks shape, scales shape)`` of a packed matrix [*rows, cols]: [*rows, cols/32, 16], [*rows, cols/32]."""
    if cols % BLOCK_SIZE:
        raise ValueError(f"a packed matrix needs a contracted width that is a multiple of {BLOCK_SIZE}, got {cols}")
    return (*rows, cols // BLOCK_SIZE, BYTES_PER_BLOCK), (*rows, cols // BLOCK_SIZE)


def _float32_bits(codes, scales):
    """uint32 bits of ``ldexp(FP4(code), scale - 127)`` for int32 ``codes`` (0..15) and ``scales`` (0..255),
    broadcast together. Nonzero magnitudes are ``(1 + f/2) * 2**(x - 1)`` for FP4 exponent field x >= 1
    and mantissa bit f (1, 1.5, 2, 3, 4, 6), and 0.5 (x = 0, f = 1): the result's biased float32 exponent
    is ``x - 1 + scale`` (``scale - 1`` for 0.5) with f as the top mantissa bit. At most 257: inf from 255;
    at least -1: a subnormal whose significand shifts right by ``1 - exponent`` (1 or 2) exactly."""
    field, f = (codes >> 1) & 3, codes & 1
    exponent = jnp.where(field > 0, field - 1 + scales, scales - 1)
    mantissa = jnp.where(field > 0, f << (_F32_MANTISSA_BITS - 1), 0)
    normal = (exponent << _F32_MANTISSA_BITS) | mantissa
    subnormal = ((1 << _F32_MANTISSA_BITS) | mantissa) >> jnp.clip(1 - exponent, 0, 31)
    magnitude = jnp.where(exponent >= 255, _F32_INF, jnp.where(exponent >= 1, normal, subnormal))
    magnitude = jnp.where((codes & 7) == 0, 0, magnitude)
    return magnitude.astype(jnp.uint32) | ((codes & 8).astype(jnp.uint32) << 28)


def unpack(blocks, scales, dtype=jnp.float32):
    """The matrix [..., C] of ``blocks`` [..., C/32, 16] and ``scales`` [..., C/32] (uint8) in ``dtype``
    (float32 or bfloat16 exactly; another float dtype through a cast of the float32 values). See the
    module docstring for the layout and the invariants."""
    *lead, groups, width = blocks.shape
    if width != BYTES_PER_BLOCK or tuple(scales.shape) != (*lead, groups):
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair")
    b, exps = blocks.astype(jnp.int32), scales.astype(jnp.int32)[..., None]
    dtype = jnp.dtype(dtype)
    halves = []
    # Each nibble's values in ``dtype`` first, interleaved last: the integer work stays inside one elementwise
    # fusion, never an int32 array of every code (4 bytes per weight: 2 GB per GPT-OSS-20B layer).
    for codes in (b & 0xF, b >> 4):  # the low nibble holds the even element
        bits = _float32_bits(codes, exps)
        if dtype == jnp.bfloat16:  # the low 16 bits are zero for every value: bfloat16 is the high half
            halves.append(jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16))
        else:
            halves.append(jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype))
    values = jnp.stack(halves, axis=-1)
    return values.reshape(*lead, groups * BLOCK_SIZE)
