"""Floating-point work and memory traffic of a compiled XLA program, read from its HLO text.

The measuring instrument of the roofline benchmark. `compiled.cost_analysis()` (XLA's HloCostAnalysis)
counts a while loop's body and condition ONCE, whatever the trip count, so a program that runs its layers
or its decode steps in a `jax.lax.scan` is under-counted by the loop's length. This module re-does XLA's
count from `jax.jit(f).lower(*args).compile().as_text()` with every loop body multiplied by its trip
count (nested loops multiply), and attributes the work to the Python functions whose lines produced it.

What is counted, and how it relates to XLA's own figures:
  * `flops`: matmul work only, 2 x output elements x contracted elements for every `dot` (contracting
    dims from `lhs_contracting_dims` on the lhs shape), and for `convolution` XLA's count: 2 x input
    features / feature groups x output features x batch / batch groups x the kernel-tap x output
    positions that land on real input (taps on padding or on lhs-dilation holes excluded), so padded,
    strided and grouped convolutions match cost_analysis. Dots inside fusions count (a fusion is how
    XLA:CPU runs most matmuls: the `ynn_fusion` / kCustom fusions).
  * `elementwise_flops`: what XLA puts in "flops" besides the matmuls, counted XLA's way: 1 per output
    element of each arithmetic / logical / compare / select / convert op, a reduce's
    (input elements - output elements) x the reducer's own ops, a sort's n x ceil(log2 n).
    `transcendentals` (exp, log, tanh, ...; 1 per element) are XLA's separate key. Without loops,
    flops + elementwise_flops and transcendentals equal cost_analysis()'s "flops" and "transcendentals".
  * `bytes`: memory traffic, XLA's "bytes accessed" rules: for each instruction of a computation that
    runs as a unit (the entry computation, loop bodies and conditions, called computations, conditional
    branches) the bytes of its operands plus its result; nothing for instructions that move no data
    (parameter, constant, tuple, get-tuple-element, bitcast, after-all, ...); a fusion counts what
    crosses its boundary, never its insides. XLA does slices and in-place updates without touching the
    whole array, and so does this count: `dynamic-slice` / `gather` / `slice` read what they output (output
    x 2 + the first index operand), `dynamic-update-slice` / `scatter` write only the update (update x 2
    + indices; scatter x 3, as XLA), and a fusion parameter that is only sliced inside the fusion is
    counted at the slice's size, a fusion whose root is a dynamic-update-slice writes only the update.
    Deliberate differences from XLA: a tuple counts 0 (XLA counts its pointer table, 8 bytes per element),
    so does an opt-barrier (XLA: operands + result), and a custom-call counts its operands + results and
    no flops (XLA reports -1, "unknown"). A fusion parameter read by a gather inside the fusion (directly
    or through a same-width bitcast-convert) counts the rows gathered; XLA charges the whole operand,
    which would bill a decode step's expert gather for every expert of the stack. Sub-byte types count
    packed (see `_DTYPE_BITS`).
  * Loops: trip count from XLA's `known_trip_count`, else derived from the condition (induction variable
    `< constant`, start and step read from the loop's initial tuple and body); a loop whose trip count
    cannot be found counts once and is reported in `unknown_trip_loops`. The body counts trip times, the
    condition trip + 1 times (it runs once more to exit).
  * Conditionals: the most expensive branch (most matmul flops, then most bytes), since which branch runs
    is not known from the program; XLA takes the maximum of each figure separately, which can mix
    branches. Called computations count once per call.
  * `by_source`: label -> (matmul flops, bytes). Label "<file>:<function>", file relative to
    `source_root` (its basename without one), function the innermost def / lambda around the source line
    (its qualified name, as Python's `__qualname__`), found with `ast`; "(no source)" for instructions
    without source information. A fusion's bytes go to the fusion's label (or, when the fusion has no
    metadata, to its root's or to any fused instruction's: XLA drops metadata on some fusions it forms);
    the flops of a dot inside a fusion go to the dot's own label. The labels' figures add up to `flops`
    and `bytes`.

The HLO text carries source locations either as `source_file=... source_line=...` in each instruction's
metadata (older jax) or as `stack_frame_id=N` into the module's FileNames / FunctionNames / FileLocations /
StackFrames tables (jax 0.10); the innermost frame is the one used, so work done in a shared helper
(a projection helper called by every layer) is labelled with the helper, not with its callers. The
function is taken from the source file when it can be read: the recorded function name is the Python
qualname with `jax_include_full_tracebacks_in_locations` on, but a name-stack scope like "jit(f)" with it
off. A file that cannot be read gives "<file>:<recorded qualname>" when the name is one, else
"<file>:<line>".

The module parses text only (no jax import), so it can measure dumps written by another process.
"""

from __future__ import annotations

import ast
import math
import os
import re
from dataclasses import dataclass, field

__all__ = ["Cost", "analyze", "shape_bytes", "top_sources"]

NO_SOURCE = "(no source)"


@dataclass(frozen=True)
class Cost:
    """Work and traffic of one compiled program, loops counted their trip count times.

    `by_source` maps a source label to (matmul flops, bytes); its figures add up to `flops` and `bytes`.
    `unknown_trip_loops` counts the while loops (static occurrences) whose trip count could not be found
    and were counted once: a non-zero value means `flops` and `bytes` are lower bounds."""

    flops: float
    elementwise_flops: float
    transcendentals: float
    bytes: float
    by_source: dict[str, tuple[float, float]] = field(hash=False)
    unknown_trip_loops: int = 0


# --------------------------------------------------------------------------------------------- shapes

# Bits per element. Sub-byte types are counted packed (4 bits for f4e2m1fn / s4 / u4), as they are stored;
# XLA's own byte count packs them only when the layout says so (`:E(4)`).
_DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e3m4": 8,
    "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
    "token": 0, "opaque": 0,
}

_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def _leaves(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a type such as `(f32[2]{0}, /*index=1*/bf16[3,4]{1,0})`."""
    out = []
    for dtype, dims in _ARRAY_RE.findall(_COMMENT_RE.sub("", shape)):
        if dtype not in _DTYPE_BITS:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        ds = tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        out.append((dtype, ds))
    return out


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO type (array or tuple, layouts and `/*index=N*/` comments allowed), tuples as the sum
    of their arrays: `shape_bytes("bf16[128,5120]{1,0}") == 1310720`. Sub-byte arrays round up to a byte."""
    return sum((math.prod(dims) * _DTYPE_BITS[dt] + 7) // 8 for dt, dims in _leaves(shape))


def _elements(shape: str) -> int:
    """Elements of an array type (of the first array of a tuple, as XLA's reduce does)."""
    leaves = _leaves(shape)
    return math.prod(leaves[0][1]) if leaves else 0


def _dims(shape: str) -> tuple[int, ...]:
    leaves = _leaves(shape)
    return leaves[0][1] if leaves else ()


# -------------------------------------------------------------------------------------------- parsing

@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    args: str  # the text between the opcode's parentheses
    operands: list[str]
    operand_shapes: list[str | None]  # inline operand types, when the text has them
    attrs: dict[str, str]
    meta: dict[str, str]


@dataclass
class _Comp:
    name: str
    is_entry: bool
    instrs: list[_Instr] = field(default_factory=list)
    by_name: dict[str, _Instr] = field(default_factory=dict)
    root: _Instr | None = None
    _users: dict[str, list[_Instr]] | None = None

    def users(self, name: str) -> list[_Instr]:
        """The instructions of this computation that take `name` as an operand, each once, in order."""
        if self._users is None:
            self._users = {}
            for ins in self.instrs:
                for op in dict.fromkeys(ins.operands):
                    self._users.setdefault(op, []).append(ins)
        return self._users.get(name, [])


@dataclass
class _Module:
    comps: dict[str, _Comp]
    entry: _Comp
    tables: dict[str, dict[int, str]]


def _unquoted(s: str, start: int = 0):
    """(index, character, bracket depth after it) of each character of s from `start` that is outside a
    quoted string."""
    depth, quote, j = 0, False, start
    while j < len(s):
        c = s[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        else:
            depth += (c in "({[") - (c in ")}]")
            yield j, c, depth
        j += 1


def _close(s: str, i: int) -> int:
    """Index of the bracket that closes the one at s[i], skipping quoted strings."""
    for j, c, depth in _unquoted(s, i):
        if c in ")}]" and depth == 0:
            return j
    raise ValueError(f"unbalanced brackets in HLO line: {s[:200]!r}")


def _split_top(s: str) -> list[str]:
    """Split at the commas outside brackets and quotes."""
    parts, start = [], 0
    for j, c, depth in _unquoted(s):
        if c == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


_HEAD_RE = re.compile(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([A-Za-z][\w\-]*)\(")
_META_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def _parse_instr(line: str) -> _Instr | None:
    line = _COMMENT_RE.sub("", line)
    m = _HEAD_RE.match(line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        j = _close(rest, 0) + 1
    else:
        j = len(rest.split(None, 1)[0]) if rest.strip() else 0
    shape, rest = rest[:j], rest[j:]
    mo = _OPCODE_RE.match(rest)
    if mo is None:
        return None
    opcode = mo.group(1)
    k = _close(rest, mo.end() - 1)
    args = rest[mo.end():k]
    operands: list[str] = []
    operand_shapes: list[str | None] = []
    if opcode not in ("constant", "parameter"):
        for piece in _split_top(args):
            toks = piece.rsplit(None, 1)
            operands.append(toks[-1].lstrip("%"))
            operand_shapes.append(toks[0] if len(toks) == 2 else None)
    attrs: dict[str, str] = {}
    for piece in _split_top(rest[k + 1:]):
        key, eq, value = piece.partition("=")
        if eq:
            attrs[key.strip()] = value.strip()
    meta: dict[str, str] = {}
    if "metadata" in attrs:
        for key, value in _META_RE.findall(attrs["metadata"].strip("{}")):
            meta[key] = re.sub(r"\\(.)", r"\1", value[1:-1]) if value.startswith('"') else value
    return _Instr(m.group(1), shape, opcode, args, operands, operand_shapes, attrs, meta)


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_COMP_RE = re.compile(r"(ENTRY\s+)?%?([^\s(]+)")


def _parse(text: str) -> _Module:
    comps: dict[str, _Comp] = {}
    tables: dict[str, dict[int, str]] = {t: {} for t in _TABLES}
    table: dict[int, str] | None = None
    comp: _Comp | None = None
    entry: _Comp | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if comp is not None:
            if line.strip() == "}":
                comp = None
                continue
            ins = _parse_instr(line)
            if ins is not None:
                comp.instrs.append(ins)
                comp.by_name[ins.name] = ins
                if line.lstrip().startswith("ROOT "):
                    comp.root = ins
            continue
        if not line.strip():
            table = None
            continue
        if line.strip() in _TABLES:
            table = tables[line.strip()]
            continue
        if table is not None:
            num, _, value = line.strip().partition(" ")
            if num.isdigit():
                table[int(num)] = value.strip()
                continue
            table = None
        if line.endswith("{") and not line[0].isspace() and not line.startswith("HloModule"):
            m = _COMP_RE.match(line)
            comp = _Comp(m.group(2), bool(m.group(1)))
            comps[comp.name] = comp
            if comp.is_entry:
                entry = comp
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    for c in comps.values():
        if c.root is None and c.instrs:
            c.root = c.instrs[-1]
    return _Module(comps, entry, tables)


def _refs(value: str) -> list[str]:
    """Computation names in an attribute value: `%body` or `{%a, %b}`."""
    return [r.lstrip("%") for r in re.findall(r"%?[\w.\-]+", value)]


def _ints(value: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", value)]


def _const_int(ins: _Instr) -> int | None:
    if ins.opcode != "constant":
        return None
    try:
        return int(ins.args.strip())
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------- sources

def _function_spans(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int], int, str]]:
    """(start, end, depth, qualname) of every def and lambda, qualnames as Python builds `__qualname__`."""
    spans = []

    def visit(node: ast.AST, prefix: str, depth: int) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                q = prefix + (child.name if not isinstance(child, ast.Lambda) else "<lambda>")
                spans.append(((child.lineno, child.col_offset),
                              (child.end_lineno or child.lineno, child.end_col_offset or 10**9), depth, q))
                visit(child, q + ".<locals>.", depth + 1)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".", depth + 1)
            else:
                visit(child, prefix, depth)

    visit(tree, "", 0)
    return spans


class _Sources:
    """Source labels, with the parsed files and the looked-up lines cached for one analysis."""

    def __init__(self, tables: dict[str, dict[int, str]], source_root: str | None, skip: tuple[str, ...] = ()):
        self.tables = tables
        self.skip = skip
        self.root = os.path.abspath(source_root) if source_root is not None else None
        self.spans: dict[str, list | None] = {}
        self.cache: dict[tuple, str] = {}

    def _path(self, file: str) -> str | None:
        candidates = [file] if os.path.isabs(file) else (
            [os.path.join(self.root, file)] if self.root else []) + [file]
        return next((p for p in candidates if os.path.isfile(p)), None)

    def _display(self, file: str, path: str | None) -> str:
        if self.root is None:
            return os.path.basename(file)
        if path is None and not os.path.isabs(file):
            return file  # "<string>", or a relative name not found under the root
        full = os.path.abspath(path or file)
        if os.path.commonpath([full, self.root]) == self.root:
            return os.path.relpath(full, self.root)
        return file

    def _function(self, path: str, line: int, col: int | None) -> str | None:
        if path not in self.spans:
            try:
                with open(path, encoding="utf-8") as f:
                    self.spans[path] = _function_spans(ast.parse(f.read(), filename=path))
            except (OSError, SyntaxError, ValueError):
                self.spans[path] = None
        spans = self.spans[path]
        if spans is None:
            return None
        best = None
        for start, end, depth, q in spans:
            inside = (start <= (line, col) <= end) if col is not None else (start[0] <= line <= end[0])
            if inside and (best is None or (depth, start) > best[0]):
                best = ((depth, start), q)
        return best[1] if best else "<module>"

    def label(self, file: str, line: int, col: int | None, recorded: str | None) -> str:
        key = (file, line, col, recorded)
        if key not in self.cache:
            path = self._path(file)
            fn = self._function(path, line, col) if path else None
            if fn is None and recorded and re.fullmatch(r"[\w<>.]+", recorded):
                fn = recorded  # the file cannot be read: the recorded qualname, when it is one
            self.cache[key] = f"{self._display(file, path)}:{fn if fn is not None else line}"
        return self.cache[key]

    def _frame_label(self, frame_id: int) -> str:
        """The label of a stack frame; a frame whose label starts with one of `skip` (a generic helper,
        e.g. the einsum every dot goes through) passes to its caller. Frames print their parent as
        `parent_frame_id` = the parent's id + 1 (1: no parent)."""
        innermost, seen = None, set()
        while frame_id > 0 and frame_id not in seen:
            seen.add(frame_id)
            frame = dict(_META_RE.findall(self.tables["StackFrames"][frame_id].strip("{}")))
            loc = dict(_META_RE.findall(self.tables["FileLocations"][int(frame["file_location_id"])].strip("{}")))
            file = self.tables["FileNames"][int(loc["file_name_id"])].strip('"')
            fn = self.tables["FunctionNames"].get(int(loc.get("function_name_id", -1)), "").strip('"')
            col = int(loc["column"]) if "column" in loc else None
            label = self.label(file, int(loc["line"]), col, fn or None)
            innermost = innermost or label
            if not any(label.startswith(prefix) for prefix in self.skip):
                return label
            frame_id = int(frame.get("parent_frame_id", 0)) - 1
        if innermost is None:
            raise KeyError(frame_id)
        return innermost  # every frame skipped

    def of(self, ins: _Instr) -> str | None:
        """The instruction's label, None when its metadata has no source location."""
        meta = ins.meta
        if "stack_frame_id" in meta:
            try:
                return self._frame_label(int(meta["stack_frame_id"]))
            except (KeyError, ValueError):
                pass
        if "source_file" in meta and "source_line" in meta:
            try:
                return self.label(meta["source_file"], int(meta["source_line"]), None, None)
            except ValueError:
                pass
        return None


# ------------------------------------------------------------------------------------------ counting

_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "power", "sqrt", "cbrt",
    "rsqrt", "tanh", "sine", "cosine", "tan", "atan2", "erf",
})
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "abs", "negate", "sign",
    "floor", "ceil", "round-nearest-afz", "round-nearest-even", "compare", "select", "clamp", "convert",
    "bitcast-convert", "stochastic-convert", "and", "or", "xor", "not", "shift-left",
    "shift-right-arithmetic", "shift-right-logical", "popcnt", "count-leading-zeros", "is-finite",
    "real", "imag", "complex", "reduce-precision",
})
# Instructions that move no data (XLA: parameter, constant, get-tuple-element, bitcast, after-all,
# add-dependency, domain count 0 bytes; tuple counts its pointer table, here 0). The control-flow ones
# are handled before this set is consulted.
_NO_DATA = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency",
    "domain", "partition-id", "replica-id", "opt-barrier", "async-update", "async-done",
})


@dataclass
class _Acc:
    flops: float = 0.0
    elementwise: float = 0.0
    transcendentals: float = 0.0
    bytes: float = 0.0
    unknown: int = 0
    by_source: dict[str, list[float]] = field(default_factory=dict)

    def add(self, label: str, flops: float, nbytes: float) -> None:
        if flops or nbytes:
            self.flops += flops
            self.bytes += nbytes
            entry = self.by_source.setdefault(label, [0.0, 0.0])
            entry[0] += flops
            entry[1] += nbytes

    def merge(self, other: _Acc) -> None:
        self.elementwise += other.elementwise
        self.transcendentals += other.transcendentals
        self.unknown += other.unknown
        for label, (f, b) in other.by_source.items():
            self.add(label, f, b)


@dataclass
class _Flops:
    """Flops of a computation run element by element inside another (fused or reducer computations)."""

    matmul: list[tuple[str | None, float]]  # (label of the dot / convolution, flops)
    elementwise: float
    transcendentals: float


class _Analyzer:
    def __init__(self, module: _Module, sources: _Sources):
        self.m = module
        self.sources = sources
        self.flops_cache: dict[str, _Flops] = {}

    # ---- shapes of operands
    def _operand_shape(self, comp: _Comp, ins: _Instr, i: int) -> str:
        inline = ins.operand_shapes[i] if i < len(ins.operand_shapes) else None
        if inline:
            return inline
        name = ins.operands[i]
        if name in comp.by_name:
            return comp.by_name[name].shape
        for c in self.m.comps.values():  # names are unique in a module; this is a fall-back
            if name in c.by_name:
                return c.by_name[name].shape
        raise ValueError(f"operand %{name} of %{ins.name} not found")

    def _operand_bytes(self, comp: _Comp, ins: _Instr, i: int) -> int:
        return shape_bytes(self._operand_shape(comp, ins, i)) if i < len(ins.operands) else 0

    def _label(self, ins: _Instr) -> str | None:
        return self.sources.of(ins)

    def _fusion_label(self, ins: _Instr) -> str:
        label = self._label(ins)
        if label is None and "calls" in ins.attrs:
            fused = self.m.comps.get(_refs(ins.attrs["calls"])[0])
            if fused is not None:
                for cand in [fused.root, *reversed(fused.instrs)]:
                    if cand is not None and (label := self._label(cand)) is not None:
                        break
        return label or NO_SOURCE

    # ---- flops
    def _matmul_flops(self, comp: _Comp, ins: _Instr) -> float:
        if ins.opcode == "dot":
            lhs = _dims(self._operand_shape(comp, ins, 0))
            k = math.prod(lhs[d] for d in _ints(ins.attrs.get("lhs_contracting_dims", "{}")))
            return 2.0 * _elements(ins.shape) * k
        if ins.opcode == "convolution":
            return _conv_flops(ins, _dims(self._operand_shape(comp, ins, 0)),
                               _dims(self._operand_shape(comp, ins, 1)), _dims(ins.shape))
        return 0.0

    def _own_flops(self, comp: _Comp, ins: _Instr) -> tuple[float, float]:
        """(elementwise, transcendental) flops of one instruction, XLA's rules."""
        op = ins.opcode
        if op in _TRANSCENDENTAL:
            return 0.0, float(_elements(ins.shape))
        if op in _ELEMENTWISE:
            return float(_elements(ins.shape)), 0.0
        if op == "reduce" and "to_apply" in ins.attrs:
            f = self._comp_flops(_refs(ins.attrs["to_apply"])[0])
            n = _elements(self._operand_shape(comp, ins, 0)) - _elements(ins.shape)
            return n * f.elementwise, n * f.transcendentals
        if op in ("map", "scatter", "reduce-window") and "to_apply" in ins.attrs:
            f = self._comp_flops(_refs(ins.attrs["to_apply"])[0])
            if op == "map":
                n = _elements(ins.shape)
            elif op == "scatter":
                n = _elements(self._operand_shape(comp, ins, len(ins.operands) - 1))
            else:
                size = re.search(r"size=([\dx]+)", ins.attrs.get("window", ""))
                window = math.prod(int(x) for x in size.group(1).split("x")) if size else 1
                n = (window - 1) * _elements(ins.shape)
            return n * f.elementwise, n * f.transcendentals
        if op == "sort":
            n = _elements(self._operand_shape(comp, ins, 0))
            return float(n * math.ceil(math.log2(n))) if n > 1 else 0.0, 0.0
        if op in ("all-reduce", "all-reduce-start"):
            return float(sum(math.prod(d) for _, d in _leaves(ins.shape))), 0.0
        if op in ("rng", "rng-bit-generator"):
            return 0.0, float(sum(math.prod(d) for _, d in _leaves(ins.shape)))
        return 0.0, 0.0

    def _comp_flops(self, name: str) -> _Flops:
        """Flops of a fused or reducer computation, nested fusions and reducers included."""
        if name not in self.flops_cache:
            self.flops_cache[name] = _Flops([], 0.0, 0.0)  # guards against cycles
            comp = self.m.comps[name]
            out = _Flops([], 0.0, 0.0)
            for ins in comp.instrs:
                if ins.opcode == "fusion" and "calls" in ins.attrs:
                    inner = self._comp_flops(_refs(ins.attrs["calls"])[0])
                    own = self._label(ins)
                    out.matmul += [(lbl or own, f) for lbl, f in inner.matmul]
                    out.elementwise += inner.elementwise
                    out.transcendentals += inner.transcendentals
                    continue
                mm = self._matmul_flops(comp, ins)
                if mm:
                    out.matmul.append((self._label(ins), mm))
                ew, tr = self._own_flops(comp, ins)
                out.elementwise += ew
                out.transcendentals += tr
            self.flops_cache[name] = out
        return self.flops_cache[name]

    # ---- bytes
    def _instr_bytes(self, comp: _Comp, ins: _Instr) -> float:
        op = ins.opcode
        if op in _NO_DATA:
            return 0.0
        out = shape_bytes(ins.shape)
        if op in ("dynamic-slice", "gather"):
            return 2.0 * out + self._operand_bytes(comp, ins, 1)
        if op == "slice":
            return 2.0 * out
        if op == "dynamic-update-slice":
            return 2.0 * self._operand_bytes(comp, ins, 1) + self._operand_bytes(comp, ins, 2)
        if op == "scatter":
            n = (len(ins.operands) - 1) // 2
            updates = sum(self._operand_bytes(comp, ins, n + 1 + i) for i in range(n))
            return 3.0 * updates + self._operand_bytes(comp, ins, n)
        return float(out + sum(self._operand_bytes(comp, ins, i) for i in range(len(ins.operands))))

    def _param_read_bytes(self, fused: _Comp, h: _Instr) -> float:
        """Bytes a fusion reads through fused parameter `h`: XLA's FusionParameterReadBytes."""
        size = 0.0
        full = shape_bytes(h.shape)
        seen_trivial = False
        for user in fused.users(h.name):
            op = user.opcode
            if op == "fusion" and "calls" in user.attrs:
                nested = self.m.comps[_refs(user.attrs["calls"])[0]]
                params = {_const_param(p): p for p in nested.instrs if p.opcode == "parameter"}
                for idx, name in enumerate(user.operands):
                    if name == h.name and idx in params:
                        size += self._param_read_bytes(nested, params[idx])
            elif op == "slice":
                size += shape_bytes(user.shape)
            elif op in ("dynamic-slice", "gather"):
                # gather: ours, not XLA's (which charges a fused gather's operand whole, i.e. a decode
                # step's expert gather with every expert of the stack): a gather reads the rows it outputs.
                if user.operands and user.operands[0] == h.name:
                    size += shape_bytes(user.shape)
                elif not seen_trivial:
                    seen_trivial = True
                    size += full
            elif op == "dynamic-update-slice":
                if (not user.operands or user.operands[0] != h.name) and not seen_trivial:
                    seen_trivial = True
                    size += full
            elif op == "bitcast-convert" and shape_bytes(user.shape) == full:
                size += self._param_read_bytes(fused, user)  # a same-width view (bf16 as u16): see through it
            elif op in ("broadcast", "reshape"):
                size += full
            elif not seen_trivial:
                seen_trivial = True
                size += full
        return size

    def _fusion_bytes(self, comp: _Comp, ins: _Instr) -> float:
        """Bytes crossing a fusion's boundary: XLA's HandleFusion byte rules."""
        fused = self.m.comps[_refs(ins.attrs["calls"])[0]]
        if ins.attrs.get("kind") == "kCustom":
            for inner in fused.instrs:  # XLA prices a custom gather / scatter fusion as the op itself
                if inner.opcode in ("gather", "scatter"):
                    return self._instr_bytes(fused, inner)
        root = fused.root
        total = 0.0
        if ins.shape.startswith("(") and root is not None and root.opcode == "tuple":
            for i, element in enumerate(_split_top(_COMMENT_RE.sub("", ins.shape)[1:-1])):
                src = fused.by_name.get(root.operands[i]) if i < len(root.operands) else None
                if src is not None and src.opcode == "dynamic-update-slice" and not element.startswith("("):
                    total += self._operand_bytes(fused, src, 1)
                else:
                    total += shape_bytes(element)
        elif root is not None and root.opcode == "dynamic-update-slice":
            total += self._operand_bytes(fused, root, 1)
        else:
            total += shape_bytes(ins.shape)
        for inner in fused.instrs:  # large constants inside the fusion are read from memory
            if inner.opcode == "constant" and _elements(inner.shape) > 1:
                total += shape_bytes(inner.shape)
        for p in fused.instrs:
            if p.opcode != "parameter":
                continue
            if p.shape.startswith("("):
                total += sum(self._param_read_bytes(fused, g) for g in fused.users(p.name)
                             if g.opcode == "get-tuple-element")
            else:
                total += self._param_read_bytes(fused, p)
        return total

    # ---- loops
    def _through(self, comp: _Comp, ins: _Instr | None) -> _Instr | None:
        while ins is not None and ins.opcode in ("copy", "bitcast", "convert", "reshape") and ins.operands:
            ins = comp.by_name.get(ins.operands[0])
        return ins

    def _binary(self, comp: _Comp, ins: _Instr | None, opcode: str) -> tuple[_Instr, _Instr, _Instr] | None:
        """(op, lhs, rhs) when `ins` is `opcode(lhs, rhs)`, or a fusion whose root is `opcode` on two of
        its parameters (XLA:CPU wraps single ops in fusions)."""
        ins = self._through(comp, ins)
        if ins is None:
            return None
        if ins.opcode == opcode and len(ins.operands) == 2:
            a, b = (self._through(comp, comp.by_name.get(o)) for o in ins.operands)
            return (ins, a, b) if a is not None and b is not None else None
        if ins.opcode == "fusion" and "calls" in ins.attrs:
            fused = self.m.comps.get(_refs(ins.attrs["calls"])[0])
            root = fused.root if fused else None
            if root is not None and root.opcode == opcode and len(root.operands) == 2:
                sides = []
                for o in root.operands:
                    p = fused.by_name.get(o)
                    idx = _const_param(p) if p is not None and p.opcode == "parameter" else None
                    if p is not None and p.opcode == "constant":
                        sides.append(p)
                    elif idx is not None and idx < len(ins.operands):
                        sides.append(self._through(comp, comp.by_name.get(ins.operands[idx])))
                    else:
                        return None
                if None not in sides:
                    return root, sides[0], sides[1]
        return None

    def _trip_count(self, comp: _Comp, ins: _Instr) -> int | None:
        known = re.search(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)', ins.attrs.get(
            "backend_config", ""))
        if known:
            return int(known.group(1))
        cond = self.m.comps.get(_refs(ins.attrs.get("condition", ""))[0])
        body = self.m.comps.get(_refs(ins.attrs.get("body", ""))[0])
        if cond is None or body is None or cond.root is None or body.root is None:
            return None
        cmp = self._binary(cond, cond.root, "compare")
        if cmp is None:
            return None
        root, a, b = cmp
        direction = root.attrs.get("direction")
        if direction == "LT":
            iv, bound = a, b
        elif direction == "GT":
            iv, bound = b, a
        else:
            return None
        limit = _const_int(bound)
        if iv.opcode != "get-tuple-element" or limit is None:
            return None
        k = int(iv.attrs.get("index", "-1"))
        init_tuple = comp.by_name.get(ins.operands[0]) if ins.operands else None
        if init_tuple is None or init_tuple.opcode != "tuple" or k >= len(init_tuple.operands):
            return None
        start = self._through(comp, comp.by_name.get(init_tuple.operands[k]))
        start_value = _const_int(start) if start is not None else None
        if body.root.opcode != "tuple" or k >= len(body.root.operands) or start_value is None:
            return None
        inc = self._binary(body, body.by_name.get(body.root.operands[k]), "add")
        if inc is None:
            return None
        _, x, y = inc
        step = None
        for var, const in ((x, y), (y, x)):
            if (var.opcode == "get-tuple-element" and var.attrs.get("index") == str(k)
                    and _const_int(const) is not None):
                step = _const_int(const)
        if not step or step <= 0:
            return None
        return max(0, -(-(limit - start_value) // step))

    # ---- the walk
    def walk(self, comp: _Comp, mult: float, acc: _Acc, stack: tuple[str, ...] = ()) -> None:
        """Count `comp`, run `mult` times, into `acc`: the computations run as a unit."""
        if comp.name in stack:
            raise ValueError(f"recursive computation {comp.name}")
        stack = (*stack, comp.name)
        for ins in comp.instrs:
            op = ins.opcode
            if op == "while":
                trip = self._trip_count(comp, ins)
                if trip is None:
                    acc.unknown += 1
                    trip = 1
                self.walk(self.m.comps[_refs(ins.attrs["body"])[0]], mult * trip, acc, stack)
                self.walk(self.m.comps[_refs(ins.attrs["condition"])[0]], mult * (trip + 1), acc, stack)
                continue
            if op == "call" or (op == "async-start" and "calls" in ins.attrs):
                target = ins.attrs.get("to_apply") or ins.attrs["calls"]
                self.walk(self.m.comps[_refs(target)[0]], mult, acc, stack)
                continue
            if op == "conditional":
                if "branch_computations" in ins.attrs:
                    names = _refs(ins.attrs["branch_computations"])
                else:
                    names = [_refs(ins.attrs[k])[0] for k in ("true_computation", "false_computation")
                             if k in ins.attrs]
                best: _Acc | None = None
                for name in names:
                    branch = _Acc()
                    self.walk(self.m.comps[name], mult, branch, stack)
                    acc.unknown += branch.unknown
                    branch.unknown = 0
                    if best is None or (branch.flops, branch.bytes) > (best.flops, best.bytes):
                        best = branch
                if best is not None:
                    acc.merge(best)
                continue
            if op == "fusion" and "calls" in ins.attrs:
                label = self._fusion_label(ins)
                acc.add(label, 0.0, mult * self._fusion_bytes(comp, ins))
                inner = self._comp_flops(_refs(ins.attrs["calls"])[0])
                for lbl, f in inner.matmul:
                    acc.add(lbl or label, mult * f, 0.0)
                acc.elementwise += mult * inner.elementwise
                acc.transcendentals += mult * inner.transcendentals
                continue
            label = self._label(ins) or NO_SOURCE
            acc.add(label, mult * self._matmul_flops(comp, ins), mult * self._instr_bytes(comp, ins))
            ew, tr = self._own_flops(comp, ins)
            acc.elementwise += mult * ew
            acc.transcendentals += mult * tr


def _window_dim_count(size: int, out: int, inp: int, stride: int, lo: int, hi: int, base: int,
                      dil: int) -> int:
    """Kernel-tap x output positions of one spatial dimension that land on real (not padding, not
    base-dilation hole) input elements: XLA's GetConvolutionFlops, its fast paths included."""
    if (inp == out and size == out and inp == base and dil == 1 and max(1, inp - 1) == stride
            and lo == 0 and hi == 0):
        return inp
    if inp == 1 and size == out and dil == 1 and base == 1 and stride == 1 and lo == out - 1 and hi == out - 1:
        return out
    count = 0
    for k in range(size):
        if stride == 1 and base == 1:
            start = lo - k * dil
            count += max(min(inp + start, out) - max(start, 0), 0)
            continue
        for o in range(out):
            undilated = o * stride - lo + k * dil
            if undilated % base == 0 and 0 <= undilated // base < inp:
                count += 1
    return count


def _conv_flops(ins: _Instr, lhs: tuple[int, ...], rhs: tuple[int, ...], out: tuple[int, ...]) -> float:
    """2 x multiply-adds of a convolution, XLA's count (taps on padding excluded). Without `dim_labels`:
    2 x output elements x kernel elements / the kernel's last (output-feature) dimension."""
    labels = re.fullmatch(r"(\w+)_(\w+)->(\w+)", ins.attrs.get("dim_labels", ""))
    if labels is None or not rhs:
        return 2.0 * math.prod(out) * math.prod(rhs) / max(rhs[-1] if rhs else 1, 1)
    lhs_l, rhs_l, out_l = labels.groups()
    window = ins.attrs.get("window", "")

    def field_(key: str, n: int, default: int) -> list[list[int]]:
        m = re.search(rf"\b{key}=(\S+)", window)
        if m is None:
            return [[default, default]] * n
        return [[int(v) for v in re.findall(r"-?\d+", part)] for part in m.group(1).split("x")]

    spatial = sorted(c for c in out_l if c.isdigit())
    n = len(spatial)
    stride, pad = field_("stride", n, 1), field_("pad", n, 0)
    base, dil = field_("lhs_dilate", n, 1), field_("rhs_dilate", n, 1)
    positions = 1
    for i, d in enumerate(spatial):
        positions *= _window_dim_count(rhs[rhs_l.index(d)], out[out_l.index(d)], lhs[lhs_l.index(d)],
                                       stride[i][0], pad[i][0], pad[i][-1], base[i][0], dil[i][0])
    groups = int(ins.attrs.get("feature_group_count", "1"))
    batch_groups = int(ins.attrs.get("batch_group_count", "1"))
    fma = (lhs[lhs_l.index("f")] // groups) * out[out_l.index("f")] * (lhs[lhs_l.index("b")] // batch_groups)
    return 2.0 * fma * positions


def _const_param(p: _Instr) -> int | None:
    """A parameter instruction's number."""
    try:
        return int(p.args.strip())
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------------ API

def analyze(hlo_text: str, *, source_root: str | None = None, skip: tuple[str, ...] = ()) -> Cost:
    """Matmul flops, elementwise flops, transcendentals and bytes of a compiled program, while loops counted
    their trip count times, attributed to source functions (see the module docstring for the rules).

    `hlo_text` is `jax.jit(f).lower(*args).compile().as_text()` (or an XLA dump of an optimized module);
    `source_root` makes the labels' file paths relative to it (None: the files' basenames). A frame whose
    label starts with one of `skip` is passed over for its caller (generic helpers that every dot or
    cast goes through would otherwise hold them all)."""
    module = _parse(hlo_text)
    analyzer = _Analyzer(module, _Sources(module.tables, source_root, skip))
    acc = _Acc()
    analyzer.walk(module.entry, 1.0, acc)
    return Cost(
        flops=acc.flops,
        elementwise_flops=acc.elementwise,
        transcendentals=acc.transcendentals,
        bytes=acc.bytes,
        by_source={label: (f, b) for label, (f, b) in acc.by_source.items()},
        unknown_trip_loops=acc.unknown,
    )


def top_sources(cost: Cost, n: int = 5, key: str = "flops") -> list[tuple[str, float, float]]:
    """The `n` source labels with the most matmul flops (key="flops") or bytes (key="bytes"), as
    (label, value, share of the program's total), largest first: where a roofline's time goes."""
    if key not in ("flops", "bytes"):
        raise ValueError(f"key must be 'flops' or 'bytes', not {key!r}")
    i = 0 if key == "flops" else 1
    total = cost.flops if key == "flops" else cost.bytes
    ranked = sorted(((label, v[i]) for label, v in cost.by_source.items() if v[i] > 0),
                    key=lambda t: (-t[1], t[0]))
    return [(label, value, value / total if total else 0.0) for label, value in ranked[:n]]
