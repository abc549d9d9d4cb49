"""Hugging Face checkpoints <-> target parameter trees.

A key table maps each Hugging Face tensor name to a path in the Flax parameter tree plus a layout change
(a transpose and reshape, done once at load). Every expected parameter must be set exactly once, with the
shape the config implies; a missing, unexpected or mis-shaped tensor is a :class:`WeightsError` naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from peagle_jax.config import ModelConfig, load_hf_config
from peagle_jax.errors import UserError

# Tensors that checkpoints may carry but that the math derives by itself.
_SKIP = re.compile(r".*rotary_emb\.inv_freq$")


class WeightsError(UserError):
    """A checkpoint that does not fit the config; the message names the tensor or file."""


_ALL = slice(None)


class _Rule:
    """One kind of tensor: HF name template <-> parameter path template, with the layout change.

    ``index`` selects the part of the parameter that the tensor fills, for stacked parameters (q/k/v in
    ``qkv_proj``, gate/up in ``gate_up_proj``); ``None`` means the whole parameter.
    """

    def __init__(self, hf: str, path: str, to_jax: Callable, to_hf: Callable, index: tuple | None = None):
        self.hf, self.path, self.to_jax, self.to_hf, self.index = hf, path, to_jax, to_hf, index
        self.hf_re = re.compile(re.escape(hf).replace(r"\{\}", r"([^./]+)") + "$")
        self.path_re = re.compile(re.escape(path).replace(r"\{\}", r"([^./]+)") + "$")


def _rules(cfg: ModelConfig) -> list[_Rule]:
    N, G, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    R = N // G
    same = (lambda w: w, lambda p: p)
    # Matrices keep HF's [out, in] layout, reshaped to expose heads. HF q_proj rows are query heads
    # n = g*R + r; they land in qkv_proj[g, r]; k and v heads in qkv_proj[g, R] and [g, R+1].
    q_w = (lambda w: w.reshape(G, R, H, D), lambda p: p.reshape(N * H, D))
    kv_w = (lambda w: w.reshape(G, H, D), lambda p: p.reshape(G * H, D))
    q_b = (lambda b: b.reshape(G, R, H), lambda p: p.reshape(N * H))
    kv_b = (lambda b: b.reshape(G, H), lambda p: p.reshape(G * H))
    o_proj = (lambda w: w.reshape(D, N, H), lambda p: p.reshape(D, N * H))
    attn, lay = "model.layers.{}.self_attn.", "layers.{}/self_attn/"
    mlp, lmlp = "model.layers.{}.mlp.", "layers.{}/mlp/"
    table = [
        ("model.embed_tokens.weight", "embed_tokens", same, None),
        ("model.norm.weight", "norm/weight", same, None),
        ("lm_head.weight", "lm_head/weight", same, None),
        (attn + "q_proj.weight", lay + "qkv_proj/weight", q_w, (_ALL, slice(0, R))),
        (attn + "k_proj.weight", lay + "qkv_proj/weight", kv_w, (_ALL, R)),
        (attn + "v_proj.weight", lay + "qkv_proj/weight", kv_w, (_ALL, R + 1)),
        (attn + "q_proj.bias", lay + "qkv_proj/bias", q_b, (_ALL, slice(0, R))),
        (attn + "k_proj.bias", lay + "qkv_proj/bias", kv_b, (_ALL, R)),
        (attn + "v_proj.bias", lay + "qkv_proj/bias", kv_b, (_ALL, R + 1)),
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
        ("model.layers.{}.{}.weight", "layers.{}/{}/weight", same, None),
    ]
    return [_Rule(hf, path, fwd, inv, index) for hf, path, (fwd, inv), index in table]


def _match(rules: list[_Rule], name: str, attr: str) -> tuple[_Rule, tuple[str, ...]] | None:
    for rule in rules:
        m = getattr(rule, attr).match(name)
        if m:
            return rule, m.groups()
    return None


def _parts(rules: list[_Rule], path: str) -> list[tuple[_Rule, str]]:
    """Every (rule, HF name) that fills parameter ``path``: one, or several for a stacked parameter."""
    parts = []
    for rule in rules:
        m = rule.path_re.match(path)
        if m:
            parts.append((rule, rule.hf.format(*m.groups())))
    return parts


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Flat ``path -> (shape, dtype)`` of every parameter, from the module itself at zero memory cost."""
    from peagle_jax.model import init_params

    tree = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return {path: (leaf.shape, leaf.dtype) for path, leaf in _flatten(tree)}


def _flatten(tree, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            yield from _flatten(value, path)
        else:
            yield path, value


def _unflatten(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Map an HF state dict (name -> array) onto the parameter tree of ``cfg``, checking every tensor."""
    expected = expected_shapes(cfg)
    rules = _rules(cfg)
    flat: dict[str, np.ndarray] = {}
    seen: set[str] = set()
    for name, array in tensors.items():
        if _SKIP.match(name):
            continue
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # some tied checkpoints store a copy of the embedding; the embedding is used
        found = _match(rules, name, "hf_re")
        if found is None:
            raise WeightsError(f"unexpected tensor {name!r} (not part of a {cfg.family} model)")
        rule, groups = found
        path = rule.path.format(*groups)
        if path not in expected:
            raise WeightsError(f"unexpected tensor {name!r}: the config has no parameter {path!r}")
        shape, dtype = expected[path]
        want = shape if rule.index is None else np.empty(shape, np.int8)[rule.index].shape
        hf_shape = tuple(rule.to_hf(np.empty(want, np.int8)).shape)
        if tuple(np.shape(array)) != hf_shape:  # checked before to_jax, whose reshape would fail unnamed
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(np.shape(array))}, which does not fit the config "
                f"(expected {hf_shape})"
            )
        value = rule.to_jax(np.asarray(array))
        if rule.index is None:
            flat[path] = value.astype(dtype)
        else:
            flat.setdefault(path, np.empty(shape, dtype))[rule.index] = value
        seen.add(name)
    missing = sorted(hf for path in expected for _, hf in _parts(rules, path) if hf not in seen)
    if missing:
        raise WeightsError(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return _unflatten(flat)


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_hf`: HF names and layouts, as numpy arrays."""
    rules = _rules(cfg)
    out = {}
    for path, value in _flatten(params):
        value = np.asarray(value)
        for rule, hf in _parts(rules, path):
            part = value if rule.index is None else value[rule.index]
            out[hf] = np.ascontiguousarray(rule.to_hf(part))
    return out


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


def load_target(model_dir: str | Path, *, dtype: str = "float32", aux_layer_ids=None):
    """(cfg, params) of a Hugging Face model directory, params placed on the default device."""
    cfg = load_hf_config(model_dir, dtype=dtype, aux_layer_ids=aux_layer_ids)
    params = params_from_hf(read_safetensors(model_dir), cfg)
    return cfg, jax.device_put(params)
