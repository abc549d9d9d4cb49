"""Hugging Face checkpoints <-> parameter trees, for the target and (through the same rules) the drafter.

A rule table maps each Hugging Face tensor name to a path in the Flax parameter tree plus a layout change
(a transpose and reshape, done once at conversion). Every expected parameter must be set exactly once, with the
shape the config implies; a missing, unexpected or mis-shaped tensor is a :class:`WeightsError` naming it.
Decoder layers are described once, by :func:`decoder_layer_rules`, for the target's layers and the drafter's.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from peagle_jax.errors import UserError
from peagle_jax.models.config import ModelConfig, load_hf_config

# Tensors that checkpoints may carry but that the math derives by itself.
SKIPPED = re.compile(r".*rotary_emb\.inv_freq$")


class WeightsError(UserError):
    """A checkpoint that does not fit the config; the message names the tensor or file."""


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
    Per-expert hub names (``experts.{e}.gate_proj.weight``) are fused first, by :func:`fuse_expert_tensors`.
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
            (mlp + "experts.gate_up_proj", lmlp + "experts/gate_up_proj", gate_up, None),
            (mlp + "experts.gate_up_proj_bias", lmlp + "experts/gate_up_proj_bias", gate_up_bias, None),
            (mlp + "experts.down_proj", lmlp + "experts/down_proj", down, None),
            (mlp + "experts.down_proj_bias", lmlp + "experts/down_proj_bias", _SAME, None),
        ]
    elif cfg.family == "qwen3_moe":
        gate_up = (lambda w: w.reshape(E, 2, F, D), lambda p: p.reshape(E, 2 * F, D))
        table += [
            (mlp + "gate.weight", lmlp + "gate/weight", _SAME, None),
            (mlp + "experts.gate_up_proj", lmlp + "experts/gate_up_proj", gate_up, None),
            (mlp + "experts.down_proj", lmlp + "experts/down_proj", _SAME, None),
        ]
    return make_rules(table, group=hf_prefix)


_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_expert_tensors(tensors: dict[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """Per-expert hub tensors ``<layer>.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE on the hub)
    stacked into transformers 5's fused ``experts.gate_up_proj`` [E, 2F, D] and ``experts.down_proj``
    [E, D, F]; every other tensor passes through. Each of the E experts must appear exactly once."""
    groups: dict[str, dict[tuple[int, str], np.ndarray]] = {}
    out = {}
    for name, array in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = array
            continue
        e = int(m.group(2))
        if not 0 <= e < num_experts:
            raise WeightsError(f"unexpected tensor {name!r}: the config has {num_experts} experts")
        groups.setdefault(m.group(1), {})[e, m.group(3)] = array
    for prefix, parts in groups.items():
        missing = [
            f"{prefix}.{e}.{w}_proj.weight"
            for e in range(num_experts)
            for w in ("gate", "up", "down")
            if (e, w) not in parts
        ]
        if missing:
            raise WeightsError(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for fused in (prefix + ".gate_up_proj", prefix + ".down_proj"):
            if fused in out:
                raise WeightsError(f"tensor {fused!r} is given both fused and per expert")
        try:
            out[prefix + ".gate_up_proj"] = np.stack(
                [np.concatenate([parts[e, "gate"], parts[e, "up"]], axis=0) for e in range(num_experts)]
            )
            out[prefix + ".down_proj"] = np.stack([parts[e, "down"] for e in range(num_experts)])
        except ValueError as err:
            raise WeightsError(f"the experts of {prefix!r} have mismatched shapes ({err})") from None
    return out


def split_expert_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of :func:`fuse_expert_tensors`: fused Qwen3-MoE experts back to the hub's per-expert names."""
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
    tensors: dict[str, np.ndarray],
    rules: list[_Rule],
    expected: dict[str, tuple[tuple[int, ...], np.dtype]],
    *,
    what: str,
    keep_dtype: bool = False,
    skip: re.Pattern = SKIPPED,
) -> dict[str, np.ndarray]:
    """Map named tensors onto flat parameter paths through ``rules``, checking every tensor.

    ``what`` names the model in errors. Values are cast to the expected dtype, or with ``keep_dtype`` keep
    the checkpoint's (a stacked parameter whose parts differ takes float32, which holds every half value).
    """
    parts: dict[str, list[tuple[_Rule, np.ndarray]]] = {}
    seen: set[str] = set()
    for name, array in tensors.items():
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
        if tuple(np.shape(array)) != hf_shape:  # checked before to_jax, whose reshape would fail unnamed
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(np.shape(array))}, which does not fit the config "
                f"(expected {hf_shape})"
            )
        parts.setdefault(path, []).append((rule, rule.to_jax(np.asarray(array))))
        seen.add(name)
    missing = sorted(hf for path in expected for _, hf in _parts(rules, path) if hf not in seen)
    if missing:
        raise WeightsError(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    flat: dict[str, np.ndarray] = {}
    for path, items in parts.items():
        shape, dtype = expected[path]
        if keep_dtype:
            dtypes = {value.dtype for _, value in items}
            dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)
        if items[0][0].index is None:
            flat[path] = items[0][1].astype(dtype, copy=not keep_dtype)
        else:
            flat[path] = np.empty(shape, dtype)
            for rule, value in items:
                flat[path][rule.index] = value
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


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig, *, keep_dtype: bool = False) -> dict:
    """Map an HF state dict (name -> array) onto the parameter tree of ``cfg``, checking every tensor.
    Values take ``cfg.dtype``, or keep the checkpoint's with ``keep_dtype`` (for lossless conversion)."""
    if cfg.tie_word_embeddings:  # some tied checkpoints store a copy of the embedding; the embedding is used
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    if cfg.family == "qwen3_moe":
        tensors = fuse_expert_tensors(tensors, cfg.moe.num_experts)
    tensors = unpack_mxfp4(tensors, "bfloat16" if keep_dtype else cfg.dtype)
    flat = flat_from_tensors(
        tensors, _rules(cfg), expected_shapes(cfg), what=f"{cfg.family} model", keep_dtype=keep_dtype
    )
    return unflatten(flat)


def unpack_mxfp4(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """GPT-OSS checkpoints on the hub store the expert weights as MXFP4 pairs (``NAME_blocks``, ``NAME_scales``):
    each pair becomes ``NAME`` in ``dtype``, one pair at a time (:func:`peagle_jax.models.mxfp4.dequantize_tensors`),
    so that peak host memory is the quantized tensors plus the dequantized ones, never an fp32 copy of all.
    A conversion keeps them in bfloat16, the dtype transformers dequantizes into. Other tensors pass through."""
    from peagle_jax.models import mxfp4

    if not any(mxfp4.is_mxfp4_name(name) for name in tensors):
        return tensors
    return mxfp4.dequantize_tensors(dict(tensors), dtype)


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


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a directory's ``*.safetensors`` (single file or sharded via the index)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shard_names = set(weight_map.values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise WeightsError(f"{index}: not a safetensors index with a 'weight_map' ({err!r})") from None
        files = sorted({model_dir / f for f in shard_names})
        for f in files:
            if not f.is_file():
                raise WeightsError(f"{index} names shard {f.name}, which is missing")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise WeightsError(
                f"{model_dir} holds only pickled PyTorch weights (*.bin); they are refused because unpickling "
                "can run code. Convert them to safetensors first (transformers: from_pretrained, then "
                "save_pretrained, which writes safetensors)"
            )
        raise WeightsError(f"{model_dir}: no *.safetensors weights found")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(f, framework="numpy") as st:
                for name in st.keys():
                    if name in tensors:
                        raise WeightsError(f"tensor {name!r} appears in more than one shard")
                    tensors[name] = st.get_tensor(name)
        except SafetensorError as err:
            raise WeightsError(f"{f}: not a readable safetensors file ({err})") from None
    return tensors


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str | int) -> int:
    """Bytes in ``'2GB'`` (decimal units, as transformers reads them), ``'500MiB'`` or ``12345``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if unit not in _SIZE_UNITS:
        raise UserError(f"not a size: {text!r} (examples: 2GB, 500MB, 512MiB)")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise UserError(f"size must be positive, got {text!r}")
    return size


def _file_mode() -> int:
    """The mode a new file gets under the process's umask (``open`` creates 0o666 & ~umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_safetensors(
    model_dir: str | Path, tensors: dict[str, np.ndarray], *, max_shard_size: int | None = None, progress=False
) -> list[Path]:
    """Write ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_size`` bytes each (a larger tensor gets a shard of its own) plus
    ``model.safetensors.index.json``, as transformers does. Returns the files written."""
    from tqdm import tqdm

    model_dir = Path(model_dir)
    total = sum(int(t.nbytes) for t in tensors.values())
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = int(tensors[name].nbytes)
        if max_shard_size is not None and shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensors[name])
        size += nbytes
    n = len(shards)
    files = [
        model_dir / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)
    ]
    for shard, f in tqdm(
        list(zip(shards, files, strict=True)), desc="writing", unit="file", disable=None if progress else True
    ):
        save_file(shard, str(f), metadata={"format": "pt"})
        f.chmod(_file_mode())  # safetensors creates its files readable by the owner only
    if n > 1:
        weight_map = {name: f.name for shard, f in zip(shards, files, strict=True) for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def load_target(model_dir: str | Path, *, dtype: str = "float32", aux_layer_ids=None):
    """(cfg, params) of a Hugging Face model directory, params placed on the default device."""
    cfg = load_hf_config(model_dir, dtype=dtype, aux_layer_ids=aux_layer_ids)
    params = params_from_hf(read_safetensors(model_dir), cfg)
    return cfg, jax.device_put(params)
