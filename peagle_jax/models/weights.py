"""Hugging Face checkpoints <-> parameter trees, for the target and (through the same rules) the drafter.

A rule table maps each Hugging Face tensor name to a path in the Flax parameter tree plus a layout change
(a transpose and reshape, done once at conversion). Every expected parameter must be set exactly once, with the
shape the config implies; a missing, unexpected or mis-shaped tensor is a :class:`WeightsError` naming it.
Decoder layers are described once, by :func:`decoder_layer_rules`, for the target's layers and the drafter's.

GPT-OSS's MXFP4 experts (``experts.*_blocks`` / ``*_scales``, :mod:`peagle_jax.models.mxfp4`) load either
packed (``MoEConfig.experts == "packed"``: the uint8 pairs, moved into our layout by the rule table, byte for
byte) or dequantized to the run dtype (``"unpacked"``); :func:`resolve_experts` picks, packed by default
where the checkpoint stores them so.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.errors import UserError
from peagle_jax.models import mxfp4
from peagle_jax.models.config import ModelConfig
from peagle_jax.models.hf_config import load_hf_config
from peagle_jax.models.tensors import (  # noqa: F401 (read_safetensors, write_safetensors, parse_size: re-exported)
    TensorSource,
    WeightsError,
    dequantized,
    fused_experts,
    open_safetensors,
    parse_size,
    read_safetensors,
    write_safetensors,
)

# Tensors that checkpoints may carry but that the math derives by itself.
SKIPPED = re.compile(r".*rotary_emb\.inv_freq$")


_ALL = slice(None)
_SAME = (lambda w: w, lambda p: p)


class _Rule:
    """One kind of tensor: HF name template <-> parameter path template, with the layout change.

    ``index`` selects the part of the parameter that the tensor fills, for stacked parameters (q/k/v in
    ``qkv_proj``, gate/up in ``gate_up_proj``); ``None`` means the whole parameter. ``group`` names the rule
    table a rule came from: where two groups match one parameter (the drafter's layer 0 and its generic
    ``layers.{}``), the earlier group names it.
    """

    def __init__(self, hf: str, path: str, to_jax: Callable, to_hf: Callable, index: tuple | None = None, group=""):
        self.hf, self.path, self.to_jax, self.to_hf, self.index, self.group = hf, path, to_jax, to_hf, index, group
        self.hf_re = re.compile(re.escape(hf).replace(r"\{\}", r"([^./]+)") + "$")
        self.path_re = re.compile(re.escape(path).replace(r"\{\}", r"([^./]+)") + "$")


def make_rules(table, group: str = "") -> list[_Rule]:
    """Rules from ``(hf template, path template, (to_jax, to_hf), index)`` rows."""
    return [_Rule(hf, path, fwd, inv, index, group) for hf, path, (fwd, inv), index in table]


def decoder_layer_rules(cfg: ModelConfig, hf_prefix: str, path_prefix: str, in_width: int) -> list[_Rule]:
    """The rules of a pre-norm decoder layer whose tensors are named ``hf_prefix + 'self_attn.q_proj.weight'``
    etc. and whose parameters live under ``path_prefix``; a ``{}`` in both prefixes stands for the layer index.

    ``in_width`` is what q/k/v read: D for the target's layers and the drafter's layers 1..L-1, 2D for the
    drafter's layer 0 (``cat[embedding, fused hidden]``). Every other norm (``input_layernorm``,
    ``post_attention_layernorm``, the drafter's ``hidden_norm``) is caught by the last row.
    """
    N, G, H, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, in_width
    J = N // G
    # Matrices keep HF's [out, in] layout, reshaped to expose heads. HF q_proj rows are query heads
    # n = g*J + j; they land in qkv_proj[g, j]; k and v heads in qkv_proj[g, J] and [g, J+1].
    q_w = (lambda w: w.reshape(G, J, H, I), lambda p: p.reshape(N * H, I))
    kv_w = (lambda w: w.reshape(G, H, I), lambda p: p.reshape(G * H, I))
    q_b = (lambda b: b.reshape(G, J, H), lambda p: p.reshape(N * H))
    kv_b = (lambda b: b.reshape(G, H), lambda p: p.reshape(G * H))
    o_proj = (lambda w: w.reshape(D, N, H), lambda p: p.reshape(D, N * H))
    same = _SAME
    attn, lay = hf_prefix + "self_attn.", path_prefix + "self_attn/"
    mlp, lmlp = hf_prefix + "mlp.", path_prefix + "mlp/"
    table = [
        (attn + "q_proj.weight", lay + "qkv_proj/weight", q_w, (_ALL, slice(0, J))),
        (attn + "k_proj.weight", lay + "qkv_proj/weight", kv_w, (_ALL, J)),
        (attn + "v_proj.weight", lay + "qkv_proj/weight", kv_w, (_ALL, J + 1)),
        (attn + "q_proj.bias", lay + "qkv_proj/bias", q_b, (_ALL, slice(0, J))),
        (attn + "k_proj.bias", lay + "qkv_proj/bias", kv_b, (_ALL, J)),
        (attn + "v_proj.bias", lay + "qkv_proj/bias", kv_b, (_ALL, J + 1)),
        (attn + "o_proj.weight", lay + "o_proj/weight", o_proj, None),
        (attn + "o_proj.bias", lay + "o_proj/bias", same, None),
        (attn + "q_norm.weight", lay + "q_norm/weight", same, None),
        (attn + "k_norm.weight", lay + "k_norm/weight", same, None),
        (mlp + "gate_proj.weight", lmlp + "gate_up_proj/weight", same, (0,)),
        (mlp + "up_proj.weight", lmlp + "gate_up_proj/weight", same, (1,)),
        (mlp + "gate_proj.bias", lmlp + "gate_up_proj/bias", same, (0,)),
        (mlp + "up_proj.bias", lmlp + "gate_up_proj/bias", same, (1,)),
        (mlp + "down_proj.weight", lmlp + "down_proj/weight", same, None),
        (mlp + "down_proj.bias", lmlp + "down_proj/bias", same, None),
        (hf_prefix + "{}.weight", path_prefix + "{}/weight", same, None),
    ]
    return make_rules(table, group=hf_prefix)


def moe_layer_rules(cfg: ModelConfig, hf_prefix: str, path_prefix: str) -> list[_Rule]:
    """The target-only tensors of GPT-OSS / Qwen3-MoE layers: attention sinks, routers and fused experts
    (:mod:`peagle_jax.models.moe` has the parameter layouts).

    GPT-OSS stores ``experts.gate_up_proj`` as [E, D, 2F] with gate and up interleaved (gate = ``[..., ::2]``)
    and ``down_proj`` as [E, F, D]; Qwen3-MoE (transformers 5) as [E, 2F, D] (gate then up) and [E, D, F].
    Per-expert hub names (``experts.{e}.gate_proj.weight``) are fused first
    (:func:`~peagle_jax.models.tensors.fused_experts`).

    Packed GPT-OSS experts: the hub's MXFP4 pairs hold each matrix's rows (the parameter's columns), so
    ``gate_up_proj_blocks`` [E, 2F, D/32, 16] has gate and up interleaved along its rows; de-interleaved, it
    is our [E, 2, F, D/32, 16], and ``down_proj_blocks`` [E, D, F/32, 16] is ours as it is (scales alike,
    without the last axis). Reshapes and transposes of whole bytes: lossless both ways.
    """
    E = cfg.moe.num_experts if cfg.moe else 0
    F = cfg.moe.intermediate_size if cfg.moe else 0
    D = cfg.hidden_size
    attn, lay = hf_prefix + "self_attn.", path_prefix + "self_attn/"
    mlp, lmlp = hf_prefix + "mlp.", path_prefix + "mlp/"
    table = [(attn + "sinks", lay + "sinks", _SAME, None)]
    if cfg.family == "gpt_oss":
        gate_up = (
            lambda w: w.reshape(E, D, F, 2).transpose(0, 3, 2, 1),
            lambda p: p.transpose(0, 3, 2, 1).reshape(E, D, 2 * F),
        )
        gate_up_bias = (
            lambda b: b.reshape(E, F, 2).transpose(0, 2, 1),
            lambda p: p.transpose(0, 2, 1).reshape(E, 2 * F),
        )
        down = (lambda w: w.transpose(0, 2, 1), lambda p: p.transpose(0, 2, 1))
        table += [
            (mlp + "router.weight", lmlp + "router/weight", _SAME, None),
            (mlp + "router.bias", lmlp + "router/bias", _SAME, None),
            (mlp + "experts.gate_up_proj_bias", lmlp + "experts/gate_up_proj_bias", gate_up_bias, None),
            (mlp + "experts.down_proj_bias", lmlp + "experts/down_proj_bias", _SAME, None),
        ]
        if cfg.moe.experts == "packed":
            gate_up_pair = (  # blocks [E, 2F, D/32, 16] <-> [E, 2, F, D/32, 16]; scales alike without the 16
                lambda b: b.reshape(E, F, 2, *b.shape[2:]).swapaxes(1, 2),
                lambda p: p.swapaxes(1, 2).reshape(E, 2 * F, *p.shape[3:]),
            )
            table += [
                (mlp + f"experts.{name}", lmlp + f"experts/{name}", layout, None)
                for name, layout in (
                    ("gate_up_proj_blocks", gate_up_pair),
                    ("gate_up_proj_scales", gate_up_pair),
                    ("down_proj_blocks", _SAME),
                    ("down_proj_scales", _SAME),
                )
            ]
        else:
            table += [
                (mlp + "experts.gate_up_proj", lmlp + "experts/gate_up_proj", gate_up, None),
                (mlp + "experts.down_proj", lmlp + "experts/down_proj", down, None),
            ]
    elif cfg.family == "qwen3_moe":
        gate_up = (lambda w: w.reshape(E, 2, F, D), lambda p: p.reshape(E, 2 * F, D))
        table += [
            (mlp + "gate.weight", lmlp + "gate/weight", _SAME, None),
            (mlp + "experts.gate_up_proj", lmlp + "experts/gate_up_proj", gate_up, None),
            (mlp + "experts.down_proj", lmlp + "experts/down_proj", _SAME, None),
        ]
    return make_rules(table, group=hf_prefix)


def split_expert_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fused Qwen3-MoE experts back to the hub's per-expert names (inverse of
    :func:`~peagle_jax.models.tensors.fused_experts`)."""
    out = {}
    for name, array in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            F = array.shape[1] // 2
            for e in range(array.shape[0]):
                out[f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = array[e, :F]
                out[f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight"] = array[e, F:]
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(array.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = array[e]
        else:
            out[name] = array
    return out


EXPERT_CHOICES = ("auto", "packed", "unpacked")


def with_experts(cfg: ModelConfig, experts: str) -> ModelConfig:
    """``cfg`` with its experts held ``experts`` (``"packed"`` or ``"unpacked"``); without experts, ``cfg``."""
    if cfg.moe is None or cfg.moe.experts == experts:
        return cfg
    return cfg.replace(moe=dataclasses.replace(cfg.moe, experts=experts))


def resolve_experts(cfg: ModelConfig, experts: str, *, mxfp4_stored: bool, where: str = "the checkpoint"):
    """``cfg`` with the expert format a load asks for: ``experts`` ``"auto"`` (packed where a GPT-OSS
    checkpoint stores its experts as MXFP4, ``mxfp4_stored``, else unpacked), ``"packed"`` (refused, as a
    :class:`UserError`, for a checkpoint without MXFP4 experts) or ``"unpacked"``. ``where`` names the
    checkpoint in errors."""
    if experts not in EXPERT_CHOICES:
        raise UserError(f"--experts {experts!r}: choose {', '.join(EXPERT_CHOICES)}")
    if experts == "packed" and cfg.family != "gpt_oss":
        raise UserError(f"--experts packed: {where} is a {cfg.family} model; packed (MXFP4) experts are GPT-OSS's")
    if experts == "packed" and not mxfp4_stored:
        raise UserError(
            f"--experts packed: {where} has no MXFP4 experts (*_blocks / *_scales tensors) to keep packed; its "
            "experts load in the run dtype (--experts unpacked or auto)"
        )
    packed = cfg.family == "gpt_oss" and mxfp4_stored and experts != "unpacked"
    return with_experts(cfg, "packed" if packed else "unpacked")


def stored_experts(params) -> str:
    """``"packed"`` where a parameter tree holds MXFP4 expert blocks, else ``"unpacked"``."""
    packed = any(path.endswith("experts/gate_up_proj_blocks") for path, _ in _flatten(params))
    return "packed" if packed else "unpacked"


def unpacked_experts(params, dtype) -> dict:
    """A parameter tree with its packed experts (if any) unpacked to ``dtype`` on the host, a matrix at a time
    (:func:`~peagle_jax.models.mxfp4.dequantize_stored`, equal to what a graph unpacks): a packed JAX
    checkpoint loaded or converted unpacked."""
    flat = flatten(params)
    out = {}
    for path, value in flat.items():
        if path.endswith(("experts/gate_up_proj_blocks", "experts/down_proj_blocks")):
            base = path.removesuffix("_blocks")
            out[base] = mxfp4.dequantize_stored(np.asarray(value), np.asarray(flat[base + "_scales"]), dtype)
        elif not path.endswith(("experts/gate_up_proj_scales", "experts/down_proj_scales")):
            out[path] = value
    return unflatten(out)


def _check_packed_pairs(source: TensorSource) -> None:
    """The MXFP4 pairs a packed load reads: at least one, each a uint8 blocks/scales pair of matching shapes
    (checked from the headers; the rule table then checks each against the config)."""
    pairs = mxfp4.mxfp4_pairs(source)
    if not pairs:
        raise WeightsError(
            "packed experts need a checkpoint with MXFP4 experts (*_blocks / *_scales tensors); this one has "
            "none (load it with --experts unpacked)"
        )
    for base, names in pairs.items():
        blocks, scales = (SimpleNamespace(shape=source.shape(n), dtype=source.dtype(n)) for n in names)
        mxfp4.check_pair(blocks, scales, base)


def _rules(cfg: ModelConfig) -> list[_Rule]:
    top = [
        ("model.embed_tokens.weight", "embed_tokens", _SAME, None),
        ("model.norm.weight", "norm/weight", _SAME, None),
        ("lm_head.weight", "lm_head/weight", _SAME, None),
    ]
    layers = decoder_layer_rules(cfg, "model.layers.{}.", "layers.{}/", cfg.hidden_size)
    return make_rules(top) + layers + moe_layer_rules(cfg, "model.layers.{}.", "layers.{}/")


def _match(rules: list[_Rule], name: str, attr: str) -> tuple[_Rule, tuple[str, ...]] | None:
    for rule in rules:
        m = getattr(rule, attr).match(name)
        if m:
            return rule, m.groups()
    return None


def _parts(rules: list[_Rule], path: str) -> list[tuple[_Rule, str]]:
    """Every (rule, HF name) that fills parameter ``path``: one, or several for a stacked parameter, all from
    the first group of rules that matches it."""
    parts = []
    for rule in rules:
        m = rule.path_re.match(path)
        if m and (not parts or rule.group == parts[0][0].group):
            parts.append((rule, rule.hf.format(*m.groups())))
    return parts


def tree_shapes(tree) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Flat ``path -> (shape, dtype)`` of a (possibly abstract) parameter tree."""
    return {path: (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in _flatten(tree)}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Flat ``path -> (shape, dtype)`` of every parameter, from the module itself at zero memory cost."""
    from peagle_jax.models.model import init_params

    return tree_shapes(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of every tensor a Hugging Face checkpoint of ``cfg`` holds (fused experts; MXFP4
    pairs where ``cfg``'s experts are packed, else the dequantized matrices), from the rule tables, without
    allocating any of them."""
    rules, out = _rules(cfg), {}
    for path, (shape, _) in expected_shapes(cfg).items():
        for rule, hf in _parts(rules, path):
            want = shape if rule.index is None else np.empty(shape, np.int8)[rule.index].shape
            out[hf] = tuple(rule.to_hf(np.empty(want, np.int8)).shape)
    return out


def _flatten(tree, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            yield from _flatten(value, path)
        else:
            yield path, value


def flatten(tree) -> dict[str, object]:
    """``{'a': {'b': x}}`` -> ``{'a/b': x}``."""
    return dict(_flatten(tree))


def unflatten(flat: dict[str, object]) -> dict:
    """The inverse of :func:`flatten`."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flat_from_tensors(
    tensors: Mapping[str, np.ndarray],
    rules: list[_Rule],
    expected: dict[str, tuple[tuple[int, ...], np.dtype]],
    *,
    what: str,
    keep_dtype: bool = False,
    skip: re.Pattern = SKIPPED,
    place: Callable[[str, np.ndarray], object] | None = None,
    progress: bool = False,
) -> dict[str, object]:
    """Map named tensors onto flat parameter paths through ``rules``, checking every tensor.

    Every name and shape is checked before any tensor is read; then each parameter is read (its parts only,
    from a :class:`~peagle_jax.models.tensors.TensorSource` that reads on demand), converted and handed to
    ``place(path, array)`` (for example ``jax.device_put``) before the next is read, so that the host holds the
    placed parameters plus one parameter's parts. ``what`` names the model in errors. Values are cast to the
    expected dtype, or with ``keep_dtype`` keep the checkpoint's (a stacked parameter whose parts differ takes
    float32, which holds every half value).
    """
    from tqdm import tqdm

    source = TensorSource.of(tensors)
    by_path: dict[str, list[tuple[_Rule, str]]] = {}
    for name in source:
        if skip.match(name):
            continue
        found = _match(rules, name, "hf_re")
        if found is None:
            raise WeightsError(f"unexpected tensor {name!r} (not part of a {what})")
        rule, groups = found
        path = rule.path.format(*groups)
        if path not in expected:
            raise WeightsError(f"unexpected tensor {name!r}: the config has no parameter {path!r}")
        names = [hf for r, hf in _parts(rules, path) if r.index == rule.index]
        if name not in names:  # a well-formed name that this layout spells otherwise (layers.0 vs midlayer)
            raise WeightsError(f"unexpected tensor {name!r}: a {what} names it {names[0]!r}")
        shape, _ = expected[path]
        want = shape if rule.index is None else np.empty(shape, np.int8)[rule.index].shape
        hf_shape = tuple(rule.to_hf(np.empty(want, np.int8)).shape)
        if source.shape(name) != hf_shape:  # checked before to_jax, whose reshape would fail unnamed
            raise WeightsError(
                f"tensor {name!r} has shape {source.shape(name)}, which does not fit the config (expected {hf_shape})"
            )
        by_path.setdefault(path, []).append((rule, name))
    seen = {name for items in by_path.values() for _, name in items}
    missing = sorted(hf for path in expected for _, hf in _parts(rules, path) if hf not in seen)
    if missing:
        raise WeightsError(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    flat: dict[str, object] = {}
    for path, items in tqdm(by_path.items(), desc="loading", unit="tensor", disable=None if progress else True):
        shape, dtype = expected[path]
        parts = [(rule, rule.to_jax(np.asarray(source[name]))) for rule, name in items]  # one parameter's parts
        if keep_dtype:
            dtypes = {part.dtype for _, part in parts}
            dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)
        if parts[0][0].index is None:
            value = parts[0][1].astype(dtype, copy=False)  # a fresh read: nothing else holds it
        else:
            value = np.empty(shape, dtype)
            for rule, part in parts:
                value[rule.index] = part
        del parts
        flat[path] = value if place is None else place(path, value)
        del value
    return flat


def flat_to_tensors(flat: dict[str, object], rules: list[_Rule], dtypes: dict | None = None) -> dict[str, np.ndarray]:
    """The inverse of :func:`flat_from_tensors`: named tensors in the checkpoint layout, as numpy arrays.
    ``dtypes`` (name -> dtype or dtype name) casts the named tensors, to write back what was read."""
    out = {}
    for path, value in flat.items():
        parts = _parts(rules, path)
        if not parts:
            raise WeightsError(f"parameter {path!r} has no checkpoint name")
        value = np.asarray(value)
        for rule, hf in parts:
            part = np.ascontiguousarray(rule.to_hf(value if rule.index is None else value[rule.index]))
            if dtypes and hf in dtypes:
                part = part.astype(jnp.dtype(dtypes[hf]), copy=False)
            out[hf] = part
    return out


def check_params(flat: dict[str, object], expected: dict, what: str) -> None:
    """Every expected parameter present, nothing else, each with its expected shape (a restored checkpoint)."""
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    if missing or unexpected:
        raise WeightsError(f"the {what}'s parameters do not fit its config: missing {missing}, unexpected {unexpected}")
    for path, value in flat.items():
        if tuple(np.shape(value)) != expected[path][0]:
            raise WeightsError(
                f"parameter {path!r} has shape {tuple(np.shape(value))}, which does not fit the {what}'s config "
                f"(expected {expected[path][0]})"
            )


def params_from_hf(
    tensors: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    *,
    keep_dtype: bool = False,
    place: Callable[[str, np.ndarray], object] | None = None,
    progress: bool = False,
) -> dict:
    """Map an HF state dict (name -> array, or a :class:`~peagle_jax.models.tensors.TensorSource` that reads on
    demand) onto the parameter tree of ``cfg``, checking every tensor. Values take ``cfg.dtype``, or keep the
    checkpoint's with ``keep_dtype`` (for lossless conversion; MXFP4 experts then take bfloat16, the dtype
    transformers dequantizes into). Packed experts (``cfg.moe.experts``) keep the MXFP4 pairs' bytes, which
    must be there. ``place`` and ``progress``: :func:`flat_from_tensors`."""
    source = TensorSource.of(tensors)
    if cfg.tie_word_embeddings:  # some tied checkpoints store a copy of the embedding; the embedding is used
        source = source.without(["lm_head.weight"])
    if cfg.family == "qwen3_moe":
        source = fused_experts(source, cfg.moe.num_experts)
    if cfg.moe is not None and cfg.moe.experts == "packed":
        _check_packed_pairs(source)
    else:
        source = dequantized(source, "bfloat16" if keep_dtype else cfg.dtype)
    flat = flat_from_tensors(
        source,
        _rules(cfg),
        expected_shapes(cfg),
        what=f"{cfg.family} model",
        keep_dtype=keep_dtype,
        place=place,
        progress=progress,
    )
    return unflatten(flat)


def params_to_hf(params: dict, cfg: ModelConfig, *, dtypes: dict | None = None) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_hf`: HF names and layouts, as numpy arrays (cast per ``dtypes``).
    Qwen3-MoE experts are written per expert, as on the hub (transformers 5 reads both)."""
    tensors = flat_to_tensors(flatten(params), _rules(cfg), dtypes)
    if cfg.family != "qwen3_moe":
        return tensors
    tensors = split_expert_tensors(tensors)
    for name in set(dtypes or ()) & set(tensors):  # the per-expert names that were read
        tensors[name] = tensors[name].astype(jnp.dtype(dtypes[name]), copy=False)
    return tensors


def load_target(
    model_dir: str | Path, *, dtype: str = "float32", aux_layer_ids=None, experts: str = "auto", progress: bool = False
):
    """(cfg, params) of a Hugging Face model directory, params placed on the default device one tensor at a
    time as they are read (peak host memory: the parameters in ``dtype`` plus one tensor's parts). MXFP4
    experts stay packed or are dequantized as ``experts`` says (:func:`resolve_experts`)."""
    cfg = load_hf_config(model_dir, dtype=dtype, aux_layer_ids=aux_layer_ids)
    source = open_safetensors(model_dir)
    cfg = resolve_experts(cfg, experts, mxfp4_stored=stores_mxfp4(source), where=str(model_dir))
    params = params_from_hf(source, cfg, place=lambda _, x: jax.device_put(x), progress=progress)
    return cfg, params


def stores_mxfp4(tensor_names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensors include MXFP4 pairs (a half pair is an error naming it)."""
    return bool(mxfp4.mxfp4_pairs(tensor_names))
