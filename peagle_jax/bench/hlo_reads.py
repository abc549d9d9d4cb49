"""Bytes a compiled step reads of each of its inputs, counted from XLA's optimized HLO.

XLA's cost analysis (``compiled.cost_analysis()["bytes accessed"]``) counts every operand of a fusion at its
full size, so a layer's packed experts count as all E experts' bytes even when the step only slices out the
k it selects; and it adds every temporary written and read again. What a memory-bound decode step costs is
what it reads of the resident arrays: :func:`input_reads` follows each entry parameter of the compiled
module (a weight, a cache) through bitcasts, reshapes and into fusions, and counts

- a ``dynamic-slice``, ``slice`` or ``gather`` of it at the bytes it returns (the selected rows or experts),
  also after a conversion or transpose fused before it (a fusion computes those for the taken elements only);
- a ``dynamic-update-slice`` into it at nothing (an update in place writes, it does not read the array);
- a pass-through into the returned tuple at nothing;
- any other use (a product, a convert, a copy, an elementwise fusion) at the whole array, once per use.

A use inside a fusion is followed into the fused computation, so a fusion that slices one expert out of a
stacked array counts that expert only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}  # fmt: skip
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_NAME = re.compile(r"%([\w.\-]+)")
_PASS = ("bitcast", "reshape", "get-tuple-element")
_SLICES = ("dynamic-slice", "slice", "gather")
_FUSED_PASS = ("convert", "bitcast-convert", "copy", "transpose")


@dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    calls: str | None
    param: int | None


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    params: dict[int, str] = field(default_factory=dict)
    users: dict[str, list[Instr]] = field(default_factory=dict)


def array_bytes(shape: str) -> int:
    """Bytes of an HLO array shape such as ``u8[24,32,90,16]{3,2,1,0}``; 0 for a tuple or token."""
    m = _ARRAY.match(shape)
    if not m or m[1] not in ITEMSIZE:
        return 0
    return ITEMSIZE[m[1]] * math.prod(int(d) for d in m[2].split(",") if d)


def _closing(text: str, depth: int = 0) -> int:
    """The index just past the parenthesis of ``text`` that closes ``depth`` already open ones (0: the
    first one opened in ``text``)."""
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i + 1
    return len(text)


def _split_instr(line: str) -> Instr | None:
    """One instruction line: ``[ROOT ]%name = SHAPE opcode(operands), attributes``."""
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)
    if not m:
        return None
    name, rest = m[1], m[2]
    if rest.startswith("("):  # a tuple shape
        end = _closing(rest)
        shape, rest = rest[:end], rest[end + 1 :]
    else:
        shape, _, rest = rest.partition(" ")
    op, _, rest = rest.partition("(")
    end = _closing(rest, 1)
    operands, attrs = rest[: end - 1], rest[end:]
    calls = _CALLS.search(attrs)
    param = int(operands) if op == "parameter" and operands.isdigit() else None
    return Instr(name, shape, op, _NAME.findall(operands), calls[1] if calls else None, param)


def parse(hlo_text: str) -> tuple[dict[str, Computation], str]:
    """Every computation of an HLO module's text by name, and the entry computation's name."""
    comps: dict[str, Computation] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = comps.setdefault(head[2], Computation(head[2]))
            entry = head[2] if head[1] else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        ins = _split_instr(line) if current is not None else None
        if ins is None:
            continue
        current.instrs[ins.name] = ins
        if ins.param is not None:
            current.params[ins.param] = ins.name
        for o in ins.operands:
            current.users.setdefault(o, []).append(ins)
    return comps, entry


def _elements(shape: str) -> int:
    m = _ARRAY.match(shape)
    return math.prod(int(d) for d in m[2].split(",") if d) if m else 0


def _reads(comps: dict[str, Computation], comp: Computation, name: str, whole: int, itemsize: int, fused: bool) -> int:
    """Bytes the uses of value ``name`` in ``comp`` read of the input it comes from (``whole``: the input's
    size, ``itemsize``: its element size). Inside a fusion (``fused``) an elementwise conversion or a
    transpose is computed only for the elements that a slice after it takes, so it passes the count on."""
    total = 0
    for user in comp.users.get(name, []):
        if user.op in _PASS or (fused and user.op in _FUSED_PASS):
            total += _reads(comps, comp, user.name, whole, itemsize, fused)
        elif user.op in _SLICES and user.operands[0] == name:
            total += _elements(user.shape) * itemsize
        elif user.op == "dynamic-update-slice" and user.operands[0] == name:
            continue  # written in place
        elif user.op == "tuple":
            continue  # passed through to the result
        elif user.op == "fusion" and user.calls in comps:
            sub = comps[user.calls]
            for k, o in enumerate(user.operands):
                if o == name and k in sub.params:
                    total += _reads(comps, sub, sub.params[k], whole, itemsize, True)
        else:
            total += whole
    return total


def input_reads(hlo_text: str) -> dict[str, int]:
    """Bytes the compiled module reads of each entry parameter, by the parameter's name in the HLO (JAX
    names them after the argument's path, for example ``params_layers_0_...`` or ``cache_k_0``)."""
    comps, entry = parse(hlo_text)
    main = comps[entry]
    out = {}
    for _, name in sorted(main.params.items()):
        whole = array_bytes(main.instrs[name].shape)
        itemsize = ITEMSIZE.get(_ARRAY.match(main.instrs[name].shape)[1], 0) if whole else 0
        out[name] = _reads(comps, main, name, whole, itemsize, False)
    return out


def input_sizes(hlo_text: str) -> dict[str, int]:
    """Bytes of each entry parameter of the compiled module, by name."""
    comps, entry = parse(hlo_text)
    main = comps[entry]
    return {name: array_bytes(main.instrs[name].shape) for _, name in sorted(main.params.items())}
