"""MXFP4 expert weights (GPT-OSS checkpoints): dequantize them as transformers does, and quantize them back.

GPT-OSS checkpoints on the Hugging Face hub store each MoE expert matrix ``NAME`` (``model.layers.{i}.mlp.
experts.gate_up_proj`` and ``...down_proj``; nothing else is quantized) as two uint8 safetensors tensors:

- ``NAME_blocks``, shape ``(E, R, G, 16)``: FP4 E2M1 codes, two per byte, the low nibble holding the even
  element; one row of ``C = 32 G`` values is ``G`` blocks of 32 values;
- ``NAME_scales``, shape ``(E, R, G)``: one E8M0 exponent per block, the block's values being
  ``FP4_VALUES[code] * 2 ** (scale - 127)``.

``E`` is the expert axis, ``R`` the rows and ``C`` the columns of the stored (dequantized) matrix, blocks
running along ``C``. transformers (``integrations/mxfp4.py``, ``convert_moe_packed_tensors``, which its
``Mxfp4Dequantize`` loading op calls) dequantizes to ``(E, R, C)`` and transposes the last two axes, and that
``(E, C, R)`` array is the parameter: ``gate_up_proj`` ``(E, hidden, 2 * intermediate)`` from blocks
``(E, 2 * intermediate, hidden / 32, 16)``, ``down_proj`` ``(E, intermediate, hidden)`` from blocks
``(E, hidden, intermediate / 32, 16)``. :func:`dequantize` returns that parameter, bit for bit:

- each value is ``ldexp(FP4_VALUES[code], scale - 127)`` in float32 (what ``torch.ldexp`` computes: the
  exact product, rounded once), then cast to the requested dtype. Every finite value is exact in float32
  and in bfloat16 (FP4 values have two significant bits; the smallest, ``0.5 * 2**-127``, is a subnormal
  of both); values of ``2**128`` or more (only from scale 253 up) are +-inf, never NaN. Scale 255, NaN in
  E8M0, is not special-cased, as transformers does not special-case it.

Invariants the functions keep: blocks and scales are uint8, ``blocks.shape == scales.shape + (16,)``, and
``dequantize`` never holds more than the output plus one chunk (``chunk_bytes``, float32 temporaries of a
few experts or a few rows of one expert), never a float32 copy of a whole bfloat16 tensor or model.

:func:`quantize` is the inverse, from the parameter layout back to blocks and scales, with the rules of the
OpenAI quantizer that transformers uses to quantize (``triton_kernels`` ``downcast_to_mxfp_torch``, scale
rounding ``ROUND_UP``): a block's scale is ``float32(max|x| / 6)`` rounded up to a power of two (so
``max|x| / 2**e <= 6`` up to that division's rounding), clamped below at ``2**-126`` (code 1), and code 0 for
an all-zero block; each value ``x / 2**e`` goes to the nearest FP4 value, ties away from zero, saturating at
+-6, the sign kept (``-0.0`` and negatives that round to zero give code 8). Unlike transformers, the input is
not rounded to bfloat16 first (float32 inputs are quantized as given). Given explicit ``scales``, it uses
them instead, so ``quantize(dequantize(b, s), s) == (b, s)`` for any blocks and any scale up to 252 (above,
large codes overflow to inf, which cannot be quantized); without them the round trip is exact for blocks
whose largest code has magnitude 4 or 6 and whose scale is at least 1 (or which are all zero with scale 0),
which is what the quantizer itself produces.

numpy only: no torch and no jax (bfloat16 comes from ``ml_dtypes``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

from peagle_jax.errors import UserError

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_CHUNK_BYTES",
    "FP4_VALUES",
    "MXFP4Error",
    "check_pair",
    "dequantize",
    "dequantize_stored",
    "is_mxfp4_name",
    "load_dequantized",
    "mxfp4_pairs",
    "parameter_shape",
    "quantize",
]

# The 16 FP4 E2M1 values by code: bit 3 is the sign, bits 0-2 index the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
BLOCK_SIZE = 32  # values per E8M0 scale, along the stored matrix's columns (the parameter's axis 1)
BYTES_PER_BLOCK = BLOCK_SIZE // 2
E8M0_BIAS = 127
FP4_MAX = 6.0
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
DEFAULT_CHUNK_BYTES = 64 << 20  # float32 temporaries per chunk

# Byte b -> twice its two values (low nibble first, i.e. the even element first): one gather decodes a byte.
# Twice, so that the scale factor 2 ** (s - 128) is a finite float32 for every s (2**-128 is a subnormal,
# 2**127 normal): the product (2 v) * 2 ** (s - 128) is then exactly ldexp(v, s - 127), overflow included.
_TWICE_PAIR_VALUES_B2 = 2 * np.stack([FP4_VALUES[np.arange(256) & 0xF], FP4_VALUES[np.arange(256) >> 4]], axis=1)
_HALF_POW2_S = np.ldexp(1.0, np.arange(256) - E8M0_BIAS - 1).astype(np.float32)
# Scale s -> float32(2 ** (127 - s)), the quantizer's multiplier (s = 255 is refused before use).
_INV_POW2_S = np.ldexp(1.0, E8M0_BIAS - np.arange(256)).astype(np.float32)
# Midpoints between consecutive FP4 magnitudes: |q| >= midpoint k rounds up past magnitude k (ties away).
_FP4_MIDPOINTS = (FP4_VALUES[1:8] + FP4_VALUES[0:7]) / 2
# float32 bytes of temporaries per dequantized / quantized value, for sizing chunks.
_DEQUANT_BYTES_PER_VALUE = 4 + 4 / BLOCK_SIZE
_QUANT_BYTES_PER_VALUE = 4 + 4 + 4 * 1 + 4 / BLOCK_SIZE


class MXFP4Error(UserError):
    """MXFP4 tensors that do not fit the format; the one-line message names the tensor."""


# -- names ----------------------------------------------------------------------------------------------------


def is_mxfp4_name(name: str) -> bool:
    """Whether a safetensors tensor name is one half of an MXFP4 pair (ends with ``_blocks`` or ``_scales``)."""
    return name.endswith(BLOCKS_SUFFIX) or name.endswith(SCALES_SUFFIX)


def mxfp4_pairs(tensor_names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{base name: (blocks name, scales name)}`` for the MXFP4 pairs among a checkpoint's tensor names.

    A ``NAME_blocks`` without ``NAME_scales`` (or the reverse), or a pair beside a plain ``NAME``, is an
    :class:`MXFP4Error`. The base name is the parameter that the pair dequantizes to.
    """
    names = set(tensor_names)
    pairs: dict[str, tuple[str, str]] = {}
    for name in sorted(names):
        for own, other in ((BLOCKS_SUFFIX, SCALES_SUFFIX), (SCALES_SUFFIX, BLOCKS_SUFFIX)):
            if not name.endswith(own):
                continue
            base = name[: -len(own)]
            if base + other not in names:
                raise MXFP4Error(f"MXFP4 tensor {name} has no matching {base + other} (a pair needs both)")
            if base in names:
                raise MXFP4Error(f"checkpoint holds both {base} and its MXFP4 pair {base}{BLOCKS_SUFFIX}")
            pairs[base] = (base + BLOCKS_SUFFIX, base + SCALES_SUFFIX)
    return pairs


# -- shapes and checks ----------------------------------------------------------------------------------------


def _check_blocks_shape(blocks_shape: tuple[int, ...], name: str) -> None:
    if len(blocks_shape) != 4 or blocks_shape[-1] != BYTES_PER_BLOCK:
        raise MXFP4Error(
            f"MXFP4 tensor {name}: blocks have shape {tuple(blocks_shape)}, expected (experts, rows, "
            f"cols/{BLOCK_SIZE}, {BYTES_PER_BLOCK})"
        )


def check_pair(blocks_ERGB: Any, scales_ERG: Any, name: str = "tensor") -> None:
    """Raise :class:`MXFP4Error` unless blocks ``(E, R, G, 16)`` and scales ``(E, R, G)`` are a uint8 pair.

    Takes anything with ``shape`` and ``dtype`` (numpy arrays; ``dtype`` may also be a safetensors dtype
    string such as ``"U8"``).
    """
    for what, array in (("blocks", blocks_ERGB), ("scales", scales_ERG)):
        dtype = array.dtype
        if str(dtype) not in ("uint8", "U8"):
            raise MXFP4Error(f"MXFP4 tensor {name}: {what} have dtype {dtype}, expected uint8")
    _check_blocks_shape(tuple(blocks_ERGB.shape), name)
    if tuple(blocks_ERGB.shape[:-1]) != tuple(scales_ERG.shape):
        raise MXFP4Error(
            f"MXFP4 tensor {name}: blocks {tuple(blocks_ERGB.shape)} and scales {tuple(scales_ERG.shape)} "
            f"disagree (expected scales {tuple(blocks_ERGB.shape[:-1])})"
        )


def parameter_shape(blocks_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The dequantized parameter's shape ``(E, C, R)`` for blocks of shape ``(E, R, G, 16)``, ``C = 32 G``."""
    _check_blocks_shape(tuple(blocks_shape), "tensor")
    E, R, G, _ = blocks_shape
    return E, G * BLOCK_SIZE, R


def _resolve_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise MXFP4Error(f"cannot dequantize MXFP4 to dtype {dtype!r}") from None
    allowed = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16))
    if resolved not in allowed:
        raise MXFP4Error(f"cannot dequantize MXFP4 to dtype {resolved} (float32, bfloat16, float16 or float64)")
    return resolved


def _chunks(E: int, R: int, rows_per_chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """``(e0, e1, r0, r1)`` covering ``(E, R)`` in chunks of at most ``rows_per_chunk`` rows: whole experts
    when at least one fits, else slices of one expert's rows."""
    if rows_per_chunk >= R:
        step = rows_per_chunk // R if R else E
        for e0 in range(0, E, max(1, step)):
            yield e0, min(E, e0 + max(1, step)), 0, R
        return
    for e in range(E):
        for r0 in range(0, R, rows_per_chunk):
            yield e, e + 1, r0, min(R, r0 + rows_per_chunk)


def _rows_per_chunk(C: int, bytes_per_value: float, chunk_bytes: int) -> int:
    return max(1, int(chunk_bytes // (C * bytes_per_value))) if C else 1


# -- dequantize -----------------------------------------------------------------------------------------------


def _dequantize_rows(blocks_ERGB: np.ndarray, scales_ERG: np.ndarray) -> np.ndarray:
    """float32 values ``(e, r, C)`` of a chunk, in the stored (untransposed) layout."""
    e, r, G, _ = blocks_ERGB.shape
    values_ERGB2 = _TWICE_PAIR_VALUES_B2[blocks_ERGB]
    with np.errstate(over="ignore"):  # scale 255 and |value| >= 1: inf, as torch.ldexp gives
        values_ERGB2 *= _HALF_POW2_S[scales_ERG][..., None, None]
    return values_ERGB2.reshape(e, r, G * BLOCK_SIZE)


def _dequantize_chunk(blocks_ERGB, scales_ERG, out_ECR, e0: int, e1: int, r0: int, r1: int) -> None:
    """Write one chunk into ``out_ECR[e0:e1, :, r0:r1]``; its temporaries die on return."""
    values_ERC = _dequantize_rows(blocks_ERGB[e0:e1, r0:r1], scales_ERG[e0:e1, r0:r1])
    out_ECR[e0:e1, :, r0:r1] = values_ERC.transpose(0, 2, 1)


def dequantize(
    blocks_ERGB: np.ndarray,
    scales_ERG: np.ndarray,
    dtype: Any = np.float32,
    *,
    name: str = "tensor",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The parameter ``(E, C, R)`` (stored ``(E, R, C)`` transposed on its last two axes), in ``dtype``.

    Equal, bit for bit, to transformers' ``convert_moe_packed_tensors(blocks, scales, dtype=dtype)``. Works
    a chunk at a time (whole experts, or rows of one expert), keeping float32 temporaries to about
    ``chunk_bytes``; ``out``, if given, is an ``(E, C, R)`` array of ``dtype`` that receives the result.
    ``name`` only labels errors.
    """
    blocks_ERGB, scales_ERG = np.asarray(blocks_ERGB), np.asarray(scales_ERG)
    check_pair(blocks_ERGB, scales_ERG, name)
    dtype = _resolve_dtype(dtype)
    E, C, R = parameter_shape(blocks_ERGB.shape)
    if out is None:
        out = np.empty((E, C, R), dtype=dtype)
    elif out.shape != (E, C, R) or out.dtype != dtype:
        raise MXFP4Error(f"MXFP4 tensor {name}: out is {out.dtype}{out.shape}, expected {dtype}{(E, C, R)}")
    for e0, e1, r0, r1 in _chunks(E, R, _rows_per_chunk(C, _DEQUANT_BYTES_PER_VALUE, chunk_bytes)):
        _dequantize_chunk(blocks_ERGB, scales_ERG, out, e0, e1, r0, r1)
    return out


def dequantize_stored(
    blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> np.ndarray:
    """The values ``[..., 32 G]`` of blocks ``[..., G, 16]`` and scales ``[..., G]`` in ``dtype``, untransposed:
    the stored layout, which is also that of the packed experts (:mod:`peagle_jax.models.mxfp4_jax`, whose
    ``unpack`` this equals bit for bit). Any number of leading axes, taken as rows R; chunked like
    :func:`dequantize`."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.ndim < 2 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise MXFP4Error(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair")
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise MXFP4Error(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    *lead, G, _ = blocks.shape
    blocks_1RGB, scales_1RG = blocks.reshape(1, -1, G, BYTES_PER_BLOCK), scales.reshape(1, -1, G)
    out_RC = np.empty((blocks_1RGB.shape[1], G * BLOCK_SIZE), _resolve_dtype(dtype))
    step = _rows_per_chunk(G * BLOCK_SIZE, _DEQUANT_BYTES_PER_VALUE, chunk_bytes)
    for r0 in range(0, out_RC.shape[0], step):
        out_RC[r0 : r0 + step] = _dequantize_rows(blocks_1RGB[:, r0 : r0 + step], scales_1RG[:, r0 : r0 + step])[0]
    return out_RC.reshape(*lead, G * BLOCK_SIZE)


# -- quantize -------------------------------------------------------------------------------------------------


def _openai_scales(values_ERGK: np.ndarray) -> np.ndarray:
    """E8M0 codes ``(e, r, G)``: ``float32(max|x| / 6)`` rounded up to a power of two (``ROUND_UP``)."""
    amax_ERG = np.abs(values_ERGK).max(axis=-1)
    bits_ERG = (amax_ERG / np.float32(FP4_MAX)).view(np.int32)
    return ((bits_ERG + 0x007FFFFF) & 0x7F800000) >> 23


def _fp4_codes(q: np.ndarray) -> np.ndarray:
    """FP4 codes (uint8) of float32 values already divided by their block scale: nearest, ties away from
    zero, saturating at +-6, sign bit from ``signbit`` (so ``-0.0`` -> 8)."""
    magnitude = np.abs(q)
    codes = np.zeros(q.shape, dtype=np.uint8)
    for midpoint in _FP4_MIDPOINTS:
        codes += magnitude >= midpoint
    codes |= np.signbit(q).astype(np.uint8) << 3
    return codes


def quantize(
    weight_ECR: np.ndarray,
    scales_ERG: np.ndarray | None = None,
    *,
    name: str = "tensor",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 ``(blocks (E, R, C/32, 16), scales (E, R, C/32))`` of a parameter ``(E, C, R)``.

    The inverse of :func:`dequantize` (see the module docstring for the rounding rules). Values are
    converted to float32 first; non-finite values are an :class:`MXFP4Error`. With ``scales_ERG`` the given
    exponents are used (values beyond ``6 * 2**(s-127)`` saturate), which makes the round trip of any
    dequantized pair exact. Works a chunk at a time like :func:`dequantize`.
    """
    weight_ECR = np.asarray(weight_ECR)
    if weight_ECR.ndim != 3 or weight_ECR.shape[1] % BLOCK_SIZE:
        raise MXFP4Error(
            f"MXFP4 tensor {name}: cannot quantize shape {weight_ECR.shape}, expected (experts, cols, rows) "
            f"with cols a multiple of {BLOCK_SIZE}"
        )
    E, C, R = weight_ECR.shape
    G = C // BLOCK_SIZE
    if scales_ERG is not None:
        scales_ERG = np.asarray(scales_ERG)
        if scales_ERG.dtype != np.uint8 or scales_ERG.shape != (E, R, G):
            raise MXFP4Error(
                f"MXFP4 tensor {name}: scales are {scales_ERG.dtype}{scales_ERG.shape}, expected uint8{(E, R, G)}"
            )
        if np.any(scales_ERG == 255):
            raise MXFP4Error(f"MXFP4 tensor {name}: scale 255 (NaN in E8M0) cannot be quantized to")
    blocks_out = np.empty((E, R, G, BYTES_PER_BLOCK), dtype=np.uint8)
    scales_out = np.empty((E, R, G), dtype=np.uint8)
    for e0, e1, r0, r1 in _chunks(E, R, _rows_per_chunk(C, _QUANT_BYTES_PER_VALUE, chunk_bytes)):
        given_ERG = None if scales_ERG is None else scales_ERG[e0:e1, r0:r1]
        chunk_ERC = weight_ECR[e0:e1, :, r0:r1].transpose(0, 2, 1)
        blocks_out[e0:e1, r0:r1], scales_out[e0:e1, r0:r1] = _quantize_rows(chunk_ERC, given_ERG, name, e0)
    return blocks_out, scales_out


def _quantize_rows(weight_ERC: np.ndarray, scales_ERG: np.ndarray | None, name: str, e0: int):
    """Blocks ``(e, r, G, 16)`` and scales ``(e, r, G)`` of a chunk in the stored layout."""
    e, r, C = weight_ERC.shape
    x_ERGK = np.ascontiguousarray(weight_ERC, dtype=np.float32).reshape(e, r, C // BLOCK_SIZE, BLOCK_SIZE)
    if not np.isfinite(x_ERGK).all():
        raise MXFP4Error(f"MXFP4 tensor {name}: cannot quantize non-finite values (experts from {e0})")
    if scales_ERG is None:
        scales_ERG = _openai_scales(x_ERGK)
    x_ERGK *= _INV_POW2_S[scales_ERG][..., None]
    codes_ERGK = _fp4_codes(x_ERGK)
    return codes_ERGK[..., 0::2] | (codes_ERGK[..., 1::2] << 4), scales_ERG


# -- safetensors ----------------------------------------------------------------------------------------------


def load_dequantized(
    source: str | os.PathLike | Any,
    base_name: str,
    dtype: Any = np.float32,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> np.ndarray:
    """The dequantized parameter ``base_name`` ``(E, C, R)`` from a safetensors file (a path, or a handle
    that ``safetensors.safe_open(path, framework="numpy")`` returned): reads only ``base_name_blocks`` and
    ``base_name_scales``, checking their dtypes and shapes before reading them."""
    if isinstance(source, str | os.PathLike):
        from safetensors import safe_open

        with safe_open(source, framework="numpy") as handle:
            return load_dequantized(handle, base_name, dtype, chunk_bytes=chunk_bytes)
    blocks_name, scales_name = base_name + BLOCKS_SUFFIX, base_name + SCALES_SUFFIX
    keys = set(source.keys())
    for tensor in (blocks_name, scales_name):
        if tensor not in keys:
            raise MXFP4Error(f"MXFP4 tensor {base_name}: the file has no {tensor}")
    blocks_info, scales_info = source.get_slice(blocks_name), source.get_slice(scales_name)
    check_pair(_Info(blocks_info), _Info(scales_info), base_name)
    return dequantize(
        source.get_tensor(blocks_name),
        source.get_tensor(scales_name),
        dtype,
        name=base_name,
        chunk_bytes=chunk_bytes,
    )


class _Info:
    """``shape`` and ``dtype`` of a safetensors slice, for :func:`check_pair` before reading the data."""

    def __init__(self, tensor_slice: Any):
        self.shape, self.dtype = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
