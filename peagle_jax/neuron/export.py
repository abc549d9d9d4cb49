"""Export every graph with ``jax.export`` for Neuron and TPU, write its artefacts, and lint it.

How a graph is lowered for a platform this machine does not have: ``jax.export.export(jitted,
platforms=[p])`` traces and lowers on the CPU for platform ``p``, without a device or plugin. jax 0.10.2
accepts ``"tpu"`` (a built-in platform) and ``"neuron"`` alike: an unregistered platform name gets jax's
default (platform-independent) lowering rules, which is exactly the StableHLO the jax-neuronx PJRT plugin
(platform name ``neuron``) receives from jax on a Trainium/Inferentia host. Lowering rules that exist
only for a platform (host callbacks, for instance) fail at export for ``neuron``: the export itself
refuses what the device could not run.

Per graph and platform, under ``OUT/<platform>/``:

- ``NAME.mlir``: the StableHLO text (what the lint reads);
- ``NAME.exported``: ``Exported.serialize()`` (reload with ``jax.export.deserialize`` and ``.call`` it on
  the device; the calling convention, shapes and donation are inside);
- ``NAME.hlo.pb``: the HLO module proto converted from that StableHLO with XLA's own converter
  (``mlir_module_to_xla_computation``), the input ``neuronx-cc compile --framework XLA`` takes;
- ``OUT/neuron/compile.sh``: one ``neuronx-cc compile`` line per graph and target (trn1, inf2, trn2).

``OUT/manifest.json`` lists every graph with its inputs, static arguments and lint findings.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jax
from jax import export

from peagle_jax import executables
from peagle_jax.neuron.graphs import Graph
from peagle_jax.neuron.lint import Finding, lint_stablehlo
from peagle_jax.platform import neuronx_cc_precision_args, static_graphs

PLATFORMS = ("neuron", "tpu")
NEURON_TARGETS = ("trn1", "inf2", "trn2")


_registered = False


def register_serialization() -> None:
    """Teach ``Exported.serialize`` the pytree types our graphs take and return (once per process)."""
    global _registered
    if _registered:
        return
    from peagle_jax.drafter.draft import Draft, DraftContext
    from peagle_jax.logit_rules import LogitRules
    from peagle_jax.logprobs import TokenLogprobs
    from peagle_jax.models.cache import KVCache
    from peagle_jax.models.model import ForwardOut
    from peagle_jax.sampling import SamplingParams
    from peagle_jax.spec.verify import VerifyOut

    for cls in (SamplingParams, ForwardOut, VerifyOut, Draft, DraftContext, LogitRules, TokenLogprobs):
        export.register_namedtuple_serialization(cls, serialized_name=f"peagle_jax.{cls.__name__}")
    # A flax.struct dataclass with no static fields: its pytree aux data is the empty tuple.
    export.register_pytree_node_serialization(
        KVCache, serialized_name="peagle_jax.KVCache", serialize_auxdata=lambda _: b"", deserialize_auxdata=lambda _: ()
    )
    _registered = True


def export_graph(graph: Graph, platform: str) -> export.Exported:
    """``graph`` lowered for ``platform``, traced branch-free (:func:`peagle_jax.platform.static_graphs`)
    for every platform: the lint holds the TPU export to Neuron's rules too."""
    register_serialization()
    with static_graphs():
        return export.export(executables.jitted(graph.fn), platforms=[platform])(*graph.args, **graph.static)


def hlo_proto(mlir_text: str) -> bytes:
    """Serialized ``HloModuleProto`` of a StableHLO module (XLA's converter, as jax's own lowering uses)."""
    from jax._src.lib import xla_client

    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
        mlir_text, use_tuple_args=False, return_tuple=False
    )
    return computation.as_serialized_hlo_module_proto()


def neuronx_cc_command(hlo_path: str, target: str, dtype: str = "bfloat16") -> str:
    """The ``neuronx-cc`` command compiling one exported HLO proto into a NEFF for ``target``; float32 graphs
    keep their products in float32 (:func:`peagle_jax.platform.neuronx_cc_precision_args`)."""
    neff = hlo_path.removesuffix(".hlo.pb") + f".{target}.neff"
    args = [
        "neuronx-cc",
        "compile",
        "--framework",
        "XLA",
        hlo_path,
        "--target",
        target,
        "--model-type",
        "transformer",
        *neuronx_cc_precision_args(dtype),
        "--output",
        neff,
    ]
    return shlex.join(args)


def _describe(x) -> str:
    if x is None:
        return "None"
    return f"{x.dtype}{list(x.shape)}"


def export_all(
    graphs: list[Graph], out: Path, platforms=PLATFORMS, *, write: bool = True, progress=None, dtype="bfloat16"
) -> dict[str, dict[str, list[Finding]]]:
    """Export, lint and (with ``write``) write every graph; returns findings per graph per platform (empty
    when clean). ``out`` may be None when nothing is written. ``dtype``, the graphs' run dtype, chooses the
    compile commands' precision flags."""
    out = Path(out) if out is not None else None
    findings: dict[str, dict[str, list[Finding]]] = {}
    manifest = []
    commands = []
    # One branch-free tracing context around the loop (entering it clears JAX's caches).
    with static_graphs():
        for graph in graphs:
            findings[graph.name] = {}
            entry = {
                "name": graph.name,
                "function": f"{graph.fn.__module__}.{getattr(graph.fn, '__name__', graph.fn)}",
                "inputs": [_describe(x) for x in jax.tree.leaves(graph.args, is_leaf=lambda x: x is None)][:12],
                "static": {
                    k: v if isinstance(v, int | bool | None) else type(v).__name__ for k, v in graph.static.items()
                },
                "lint": {},
            }
            for platform in platforms:
                exported = export_graph(graph, platform)
                text = exported.mlir_module()
                found = lint_stablehlo(text)
                findings[graph.name][platform] = found
                entry["lint"][platform] = [str(f) for f in found]
                if write:
                    d = out / platform
                    d.mkdir(parents=True, exist_ok=True)
                    (d / f"{graph.name}.mlir").write_text(text)
                    (d / f"{graph.name}.exported").write_bytes(exported.serialize())
                    (d / f"{graph.name}.hlo.pb").write_bytes(hlo_proto(text))
                    if platform == "neuron":
                        commands += [neuronx_cc_command(f"{graph.name}.hlo.pb", t, dtype) for t in NEURON_TARGETS]
            manifest.append(entry)
            if progress is not None:
                progress(graph.name)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").write_text(json.dumps({"graphs": manifest}, indent=1) + "\n")
    if write and "neuron" in platforms:
        header = [
            "#!/bin/sh",
            "# neuronx-cc commands for every exported graph (written by python -m peagle_jax.neuron export).",
            "# Run on a host with neuronx-cc, or through neuron/compile.sh.",
            "set -e",
            'cd "$(dirname "$0")"',
        ]
        path = out / "neuron" / "compile.sh"
        path.write_text("\n".join([*header, *commands]) + "\n")
        path.chmod(0o755)
    return findings
