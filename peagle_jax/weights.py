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
from safetensors import safe_open

from peagle_jax.config import ModelConfig, load_hf_config
from peagle_jax.errors import UserError

# Tensors that checkpoints may carry but that the math derives by itself.
_SKIP = re.compile(r".*rotary_emb\.inv_freq$")


class WeightsError(UserError):
    """A checkpoint that does not fit the config; the message names the tensor or file."""


class _Rule:
    """One kind of tensor: HF name template <-> parameter path template, with the layout change."""

    def __init__(self, hf: str, path: str, to_jax: Callable, to_hf: Callable):
        self.hf, self.path, self.to_jax, self.to_hf = hf, path, to_jax, to_hf
        self.hf_re = re.compile(re.escape(hf).replace(r"\{\}", r"([^./]+)") + "$")
        self.path_re = re.compile(re.escape(path).replace(r"\{\}", r"([^./]+)") + "$")


def _rules(cfg: ModelConfig) -> list[_Rule]:
    N, G, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

    def heads_in(n):  # [n*H, D] <-> [D, n, H]
        return lambda w: w.T.reshape(D, n, H), lambda p: p.reshape(D, n * H).T

    def heads_bias(n):  # [n*H] <-> [n, H]
        return lambda b: b.reshape(n, H), lambda p: p.reshape(n * H)

    same = (lambda w: w, lambda p: p)
    transpose = (lambda w: w.T, lambda p: p.T)
    o_proj = (lambda w: w.T.reshape(N, H, D), lambda p: p.reshape(N * H, D).T)
    attn, lay = "model.layers.{}.self_attn.", "layers.{}/self_attn/"
    table = [
        ("model.embed_tokens.weight", "embed_tokens", same),
        ("model.norm.weight", "norm/weight", same),
        ("lm_head.weight", "lm_head/kernel", transpose),
        (attn + "q_proj.weight", lay + "q_proj/kernel", heads_in(N)),
        (attn + "k_proj.weight", lay + "k_proj/kernel", heads_in(G)),
        (attn + "v_proj.weight", lay + "v_proj/kernel", heads_in(G)),
        (attn + "q_proj.bias", lay + "q_proj/bias", heads_bias(N)),
        (attn + "k_proj.bias", lay + "k_proj/bias", heads_bias(G)),
        (attn + "v_proj.bias", lay + "v_proj/bias", heads_bias(G)),
        (attn + "o_proj.weight", lay + "o_proj/kernel", o_proj),
        (attn + "o_proj.bias", lay + "o_proj/bias", same),
        (attn + "q_norm.weight", lay + "q_norm/weight", same),
        (attn + "k_norm.weight", lay + "k_norm/weight", same),
        ("model.layers.{}.mlp.{}.weight", "layers.{}/mlp/{}/kernel", transpose),
        ("model.layers.{}.mlp.{}.bias", "layers.{}/mlp/{}/bias", same),
        ("model.layers.{}.{}.weight", "layers.{}/{}/weight", same),
    ]
    return [_Rule(hf, path, fwd, inv) for hf, path, (fwd, inv) in table]


def _match(rules: list[_Rule], name: str, attr: str) -> tuple[_Rule, tuple[str, ...]] | None:
    for rule in rules:
        m = getattr(rule, attr).match(name)
        if m:
            return rule, m.groups()
    return None


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
        value = rule.to_jax(np.asarray(array))
        shape, dtype = expected[path]
        if value.shape != shape:
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(np.shape(array))}, which does not fit the config "
                f"(expected {tuple(rule.to_hf(np.empty(shape, np.float32)).shape)})"
            )
        flat[path] = value.astype(dtype)
    missing = sorted(set(expected) - set(flat))
    if missing:
        names = [_hf_name(rules, p) for p in missing]
        raise WeightsError(f"missing tensor(s) {names[:5]}{' ...' if len(names) > 5 else ''}")
    return _unflatten(flat)


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_hf`: HF names and layouts, as numpy arrays."""
    rules = _rules(cfg)
    out = {}
    for path, value in _flatten(params):
        rule, groups = _match(rules, path, "path_re")
        out[rule.hf.format(*groups)] = np.ascontiguousarray(rule.to_hf(np.asarray(value)))
    return out


def _hf_name(rules: list[_Rule], path: str) -> str:
    rule, groups = _match(rules, path, "path_re")
    return rule.hf.format(*groups)


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a directory's ``*.safetensors`` (single file or sharded via the index)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise WeightsError(f"{index} names shard {f.name}, which is missing")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise WeightsError(
                f"{model_dir} holds only pickled PyTorch weights (*.bin); they are refused because unpickling "
                "can run code. Convert them to safetensors first (transformers: save_pretrained(..., "
                "safe_serialization=True))"
            )
        raise WeightsError(f"{model_dir}: no *.safetensors weights found")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(f, framework="numpy") as st:
            for name in st.keys():
                if name in tensors:
                    raise WeightsError(f"tensor {name!r} appears in more than one shard")
                tensors[name] = st.get_tensor(name)
    return tensors


def load_target(model_dir: str | Path, *, dtype: str = "float32", aux_layer_ids=None):
    """(cfg, params) of a Hugging Face model directory, params placed on the default device."""
    cfg = load_hf_config(model_dir, dtype=dtype, aux_layer_ids=aux_layer_ids)
    params = params_from_hf(read_safetensors(model_dir), cfg)
    return cfg, jax.device_put(params)
