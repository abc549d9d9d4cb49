"""A lint over exported StableHLO text: what Neuron (neuronx-cc) does not support, or runs badly.

Each rule is a pattern over the pretty-printed StableHLO module that ``jax.export`` produces (one op per
line, regions indented). The rules, with the reason each construct is refused:

- ``dynamic-shape``: a ``?`` dimension. Neuron compiles fixed shapes only; every graph here has its
  shapes fixed by buckets.
- ``control-flow``: ``stablehlo.case`` / ``stablehlo.if`` (from ``lax.cond`` / ``lax.switch``):
  data-dependent branches are not supported in a NEFF; use masks (``jnp.where``).
- ``dynamic-while``: a ``stablehlo.while`` whose trip count is not static, i.e. whose condition is not
  ``counter < constant`` with the counter starting at a constant (what ``lax.fori_loop`` / ``lax.scan``
  with static bounds produce).
- ``variadic-reduce``: a reduction carrying several operands (``(value, index)`` pairs: ``jnp.argmax``'s
  usual lowering) over more than ``large_reduce`` elements; use max + compare + min-index
  (:func:`peagle_jax.ops.argmax_first`).
- ``large-sort``: ``stablehlo.sort`` over a dimension above ``max_sort`` (16384) elements, or top-k
  (``chlo.top_k``) with k above it. The sort inside ``chlo.top_k``'s own decomposition is not checked:
  the composite converts to XLA's ``topk`` instruction, whose limit is on k.
- ``int64``: a 64-bit integer tensor (``i64`` / ``ui64``); keep ids and counters int32.
- ``threefry``: threefry random bits (``jax.random`` with the default key); pass uniforms in, or hash
  counters in uint32 (:func:`peagle_jax.sampling.uniforms`).
- ``host-callback``: a host callback (``jax.pure_callback``, ``io_callback``, ``jax.debug``) or
  host send/recv/infeed/outfeed: nothing may leave the device inside a graph.
- ``custom-call``: a custom call to anything but the sharding annotations XLA's partitioner itself
  emits (:data:`KNOWN_CUSTOM_CALLS`): an unknown kernel that neuronx-cc cannot lower.
"""

from __future__ import annotations

import dataclasses
import math
import re

MAX_SORT = 16384  # neuronx-cc's limit on a sort / top-k extent
LARGE_REDUCE = 1024  # a variadic reduction over more elements than this runs badly
KNOWN_CUSTOM_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
KNOWN_COMPOSITES = frozenset({"chlo.top_k"})  # lowered as one instruction, their decompositions unused
RULES = (
    "dynamic-shape",
    "control-flow",
    "dynamic-while",
    "variadic-reduce",
    "large-sort",
    "int64",
    "threefry",
    "host-callback",
    "custom-call",
)


@dataclasses.dataclass(frozen=True)
class Finding:
    rule: str
    line: int  # 1-based line in the StableHLO text
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: [{self.rule}] {self.message}"


_TENSOR = re.compile(r"tensor<([^<>]*)>")
_DYNAMIC = re.compile(r"tensor<[^<>]*\?")
_INT64 = re.compile(r"tensor<(?:[0-9?]+x)*u?i64>")
_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)")
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call\s+@([\w.$-]+)|call_target_name\s*=\s*\"([^\"]+)\"")
_COMPOSITE = re.compile(r'stablehlo\.composite\s+"([\w.]+)".*?decomposition\s*=\s*@([\w.$-]+)')
_CONST = re.compile(r"^\s*(%[\w]+)\s*=\s*stablehlo\.constant\b")
_RESULT = re.compile(r"^\s*%[\w]+(?::(\d+))?\s*=")


def _dims(type_text: str) -> list[int]:
    """``2x100xf32`` -> [2, 100] (a ``?`` dimension counts as 0)."""
    return [int(d) if d.isdigit() else 0 for d in type_text.split("x")[:-1]]


def _first_tensor(text: str) -> list[int] | None:
    m = _TENSOR.search(text)
    return _dims(m.group(1)) if m else None


def _region_end(lines: list[str], start: int) -> int:
    """Index of the line closing the op that opens at ``start`` (same indentation, starting with ``}``)."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    for j in range(start + 1, len(lines)):
        stripped = lines[j].lstrip()
        if stripped.startswith("}") and len(lines[j]) - len(stripped) == indent:
            return j
    return len(lines) - 1


def _functions(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Function name -> (first line, last line) index range."""
    out = {}
    for i, line in enumerate(lines):
        m = _FUNC.match(line)
        if m:
            out[m.group(1)] = (i, _region_end(lines, i))
    return out


def _static_while(lines: list[str], i: int, constants: set[str]) -> bool:
    """Whether the while at line i compares a counter that starts at a constant against a constant."""
    inits = dict(re.findall(r"(%iterArg\w*)\s*=\s*(%[\w#]+)", lines[i]))
    j = i + 1
    aliases: dict[str, str] = {}
    while j < len(lines) and not re.match(r"^\s*\}\s*do\s*\{", lines[j]):
        line = lines[j]
        conv = re.match(r"^\s*(%\w+)\s*=\s*stablehlo\.convert\s+(%\w+)", line)
        if conv:
            aliases[conv.group(1)] = aliases.get(conv.group(2), conv.group(2))
        m = _CONST.match(line)
        if m:
            constants = constants | {m.group(1)}
        cmp = re.search(r"stablehlo\.compare\s+(LT|LE|GT|GE|NE),\s*(%[\w#]+),\s*(%[\w#]+)", line)
        if cmp:
            a, b = (aliases.get(x, x) for x in cmp.group(2, 3))
            for counter, bound in ((a, b), (b, a)):
                if counter in inits and inits[counter] in constants and bound in constants:
                    return True
            return False
        j += 1
    return False


def lint_stablehlo(text: str, *, max_sort: int = MAX_SORT, large_reduce: int = LARGE_REDUCE) -> list[Finding]:
    """All findings in one StableHLO module's text, in line order."""
    lines = text.splitlines()
    findings: list[Finding] = []
    funcs = _functions(lines)
    skipped = set()  # lines inside the decompositions of known composites
    for line in lines:
        m = _COMPOSITE.search(line)
        if m and m.group(1) in KNOWN_COMPOSITES and m.group(2) in funcs:
            first, last = funcs[m.group(2)]
            skipped.update(range(first, last + 1))
    constants = {m.group(1) for line in lines if (m := _CONST.match(line))}

    def add(rule, i, message):
        findings.append(Finding(rule, i + 1, message))

    for i, line in enumerate(lines):
        if i in skipped or line.lstrip().startswith("#loc"):
            continue
        code = line.split(" loc(")[0]
        if _DYNAMIC.search(code):
            add("dynamic-shape", i, "a tensor with a dynamic (?) dimension")
        if re.search(r"\bstablehlo\.(case|if)\b", code):
            add("control-flow", i, "stablehlo.case/if (lax.cond / lax.switch): branch with masks instead")
        if re.search(r"\bstablehlo\.while\b", code) and not _static_while(lines, i, constants):
            add("dynamic-while", i, "a while loop whose trip count is not a static constant")
        result = _RESULT.match(code)
        if re.search(r"\bstablehlo\.reduce\b|\"stablehlo\.reduce\"", code) and result and result.group(1):
            n = int(result.group(1))
            dims_m = re.search(r"dimensions\s*=\s*(?:\[([\d,\s]*)\]|array<i64:\s*([\d,\s]*)>)", code)
            sig_line = code if "->" in code else lines[_region_end(lines, i)]
            shape = _first_tensor(sig_line.split(" : ", 1)[-1])
            if n > 1 and dims_m and shape is not None:
                axes = [int(a) for a in (dims_m.group(1) or dims_m.group(2) or "").replace(" ", "").split(",") if a]
                size = math.prod(shape[a] for a in axes)
                if size > large_reduce:
                    add("variadic-reduce", i, f"a {n}-operand reduction over {size} elements (argmax-style)")
        if re.search(r"\bstablehlo\.sort\b|\"stablehlo\.sort\"", code):
            dim = re.search(r"dimension\s*=\s*(\d+)", code)
            shape = _first_tensor(lines[_region_end(lines, i)].split(" : ", 1)[-1])
            if dim and shape is not None and shape[int(dim.group(1))] > max_sort:
                add("large-sort", i, f"a sort over {shape[int(dim.group(1))]} elements (> {max_sort})")
        top_k = re.search(r"chlo\.top_k.*?\bk\s*=\s*(\d+)", code)
        if top_k and int(top_k.group(1)) > max_sort:
            add("large-sort", i, f"top-k with k = {top_k.group(1)} (> {max_sort})")
        if _INT64.search(code):
            add("int64", i, "a 64-bit integer tensor")
        if re.search(r"threefry", code, re.IGNORECASE):
            add("threefry", i, "threefry random bits (jax.random with a threefry key)")
        if re.search(r"\bstablehlo\.(send|recv|infeed|outfeed)\b|\"stablehlo\.(send|recv|infeed|outfeed)\"", code):
            add("host-callback", i, "a host transfer (send/recv/infeed/outfeed)")
        for m in _CUSTOM_CALL.finditer(code):
            target = m.group(1) or m.group(2)
            if "callback" in target.lower():
                add("host-callback", i, f"a host callback (custom call {target})")
            elif "threefry" in target.lower():
                pass  # reported by the threefry rule
            elif target not in KNOWN_CUSTOM_CALLS:
                add("custom-call", i, f"an unknown custom call @{target}")
    return findings


def format_findings(name: str, findings: list[Finding]) -> str:
    return "\n".join(f"{name}: {f}" for f in findings)
