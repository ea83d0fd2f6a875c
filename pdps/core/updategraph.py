"""Update rules as data: the graph a pserver runs instead of importing a user's optimizer.

An *update rule* is what an optimizer does to one parameter: from the parameter, its
gradient and its state (Adam's ``step``, ``exp_avg``, ...) to the new parameter and the
new state. pdps ships it to the pservers as JSON (:func:`check` parses and checks it),
so a pserver runs a user-defined rule without importing, unpickling or executing
anything the user wrote. This module owns the format and its checker; tracing an
optimizer into this format and running it are torch's, in
:mod:`pdps.adapters.torch_graph`.

Rules of this module:

* A rule holds two *programs*: ``first`` (inputs ``param, grad``) runs on a block that
  has no state yet and makes it, ``step`` (inputs ``param, grad`` and the state, in
  :attr:`UpdateRule.state` order) runs on every later step. Both output the new
  parameter, then each state entry, in that order. Programs are functional: no node
  writes into its inputs.
* A node applies one operator of :data:`ALLOWED_OPS`, all element-wise: each element of
  the result depends on the same element of each tensor argument alone (0-d tensors
  broadcast). So a rule updates any cut of a parameter exactly as it updates the whole,
  which is what lets each pserver step its shard on its own. Reductions (norms, sums,
  means), sorting, matrix products and view changes are not in the list: a rule with
  global-norm clipping inside ``step`` is refused.
* Every tensor of a program is shaped like the parameter (``"param"``) or 0-d
  (``"scalar"``); constants and tensors made from nothing (``zeros([])``) are 0-d.
* Arguments are JSON: numbers, booleans, null, short strings, lists of them, and the
  objects ``{"ref": name}`` (an input, constant or earlier node), ``{"dtype": name}``
  and ``{"float": "inf" | "-inf" | "nan"}``. Constants carry their raw little-endian
  bytes in base64 with their dtype and shape. Nothing is pickled.
* :func:`check` refuses, before anything runs, with :class:`BadGraph` naming the
  program, the node and the operator: an unknown operator, a reference to a name not
  defined before it (a missing node, a forward reference, a cycle), a shape that is
  not 0-d where one must be (too large ones are named as such), a constant whose bytes
  do not match its dtype and shape, an unknown dtype, more nodes or constant bytes than
  the :class:`GraphBudget`, outputs that do not match the parameter and its state.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import BadGraph

FORMAT = "pdps.update/1"

#: dtypes a rule's tensors may have, and their size in bytes
DTYPES: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}

_UNARY = (
    "abs", "neg", "sign", "sgn", "sqrt", "rsqrt", "exp", "expm1", "log", "log1p", "reciprocal", "sigmoid", "tanh", "relu",
    "square", "clone", "logical_not", "isnan", "isfinite", "floor", "ceil", "round", "trunc",
)
_BINARY = ("add", "sub", "rsub", "mul", "div", "fmod", "remainder", "gt", "ge", "lt", "le", "eq", "ne")

#: Operators a rule may use (aten ``packet.overload``), each element-wise. Functional
#: forms only: an in-place operator (``add_``) would write into a program's input.
ALLOWED_OPS: frozenset[str] = frozenset(
    [f"{op}.default" for op in _UNARY]
    + [f"{op}.{o}" for op in _BINARY for o in ("Tensor", "Scalar")]
    + [
        "div.Tensor_mode", "div.Scalar_mode",
        "pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar",
        "maximum.default", "minimum.default", "fmax.default", "fmin.default",
        "where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar",
        "lerp.Scalar", "lerp.Tensor", "addcmul.default", "addcdiv.default",
        "clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_min.Tensor", "clamp_max.default", "clamp_max.Tensor",
        "logical_and.default", "logical_or.default", "logical_xor.default",
        "copy.default", "_to_copy.default",
        "zeros_like.default", "ones_like.default", "full_like.default",
        "zeros.default", "ones.default", "full.default", "scalar_tensor.default",
    ]
)

#: operators that make a tensor from a shape argument (the first): only 0-d ones
SHAPED_FACTORIES = frozenset({"zeros.default", "ones.default", "full.default"})
#: operators whose result is shaped like their first argument alone
LIKE_FIRST = frozenset({"zeros_like.default", "ones_like.default", "full_like.default", "clone.default", "_to_copy.default", "copy.default"})
#: operators that make a 0-d tensor from a number
SCALAR_FACTORIES = frozenset({"scalar_tensor.default"})

#: keyword arguments a node may pass (device, layout, pin_memory and memory_format are the
#: runner's to choose, so a rule never names them)
ALLOWED_KWARGS = frozenset({"alpha", "value", "dtype", "rounding_mode", "min", "max", "non_blocking"})

_MAX_TEXT = 64  # a string argument (rounding_mode)
_MAX_LIST = 8  # a list argument (a shape)
_NAME_MAX = 128
_WHERE_MAX = 400

PARAM = "param"
SCALAR = "scalar"


@attrs.frozen
class GraphBudget:
    """How large a rule a pserver accepts: nodes per program, constants per program, and
    the bytes of all of a program's constants; ``max_elements`` bounds any shape named
    (it is refused as too large before it is refused as not 0-d)."""

    max_nodes: int = 512
    max_constants: int = 64
    max_constant_bytes: int = 1 << 16
    max_elements: int = 1 << 20


DEFAULT_BUDGET = GraphBudget()


@attrs.frozen
class Ref:
    """A reference to an input, a constant or an earlier node of the same program."""

    name: str


@attrs.frozen
class DType:
    """A dtype passed as an argument (``_to_copy(x, dtype=float32)``)."""

    name: str


@attrs.frozen
class Constant:
    """A 0-d tensor held in the rule: ``data`` is its raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


@attrs.frozen
class Node:
    """One operator applied: ``name = op(*args, **kwargs)``; ``where`` is the user's source
    line it was traced from ("" when unknown)."""

    name: str
    op: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    where: str = ""


@attrs.frozen
class Program:
    """Checked nodes in order; ``kinds`` says of each name whether it is shaped like the
    parameter (:data:`PARAM`) or 0-d (:data:`SCALAR`)."""

    inputs: tuple[str, ...]
    constants: Mapping[str, Constant]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    kinds: Mapping[str, str]


@attrs.frozen
class StateSpec:
    """One entry of a parameter's state: shaped like the parameter or 0-d, of ``dtype``."""

    name: str
    shape: str
    dtype: str


@attrs.frozen
class UpdateRule:
    """A checked rule (:func:`check`): the parameters' ``dtype``, the ``state`` entries,
    the ``first`` and ``step`` programs, a human ``about`` line and ``digest``, the
    sha256 of the rule's canonical JSON (equal rules, equal digests)."""

    dtype: str
    state: tuple[StateSpec, ...]
    first: Program
    step: Program
    about: str
    digest: str


# --- the checker -------------------------------------------------------------------------


def check(graph: Any, budget: GraphBudget = DEFAULT_BUDGET) -> UpdateRule:
    """Parse and check the JSON form of an update rule; raises :class:`BadGraph` naming
    what is wrong (the program, the node, the operator) before anything runs."""
    if not isinstance(graph, Mapping):
        raise BadGraph(f"an update rule must be a JSON object, got {type(graph).__name__}", field="graph")
    if graph.get("format") != FORMAT:
        raise BadGraph(f"update rule format {graph.get('format')!r:.60} is not {FORMAT!r}", field="format")
    extra = sorted(set(graph) - {"format", "dtype", "state", "first", "step", "about"})
    if extra:
        raise BadGraph(f"update rule has unknown fields {extra!r:.200}", field=str(extra[0]))
    dtype = _dtype(graph.get("dtype"), "the rule's dtype")
    if dtype not in ("float64", "float32", "float16", "bfloat16"):
        raise BadGraph(f"the rule's dtype {dtype!r} is not a floating dtype", field="dtype")
    state = _state(graph.get("state"))
    about = graph.get("about", "")
    if not isinstance(about, str) or len(about) > 1000:
        raise BadGraph("update rule field 'about' must be a string of at most 1000 characters", field="about")
    kinds = {PARAM: PARAM, "grad": PARAM}
    names = [s.name for s in state]
    first = _program(graph.get("first"), "first", ("param", "grad"), kinds, state, budget)
    step = _program(graph.get("step"), "step", ("param", "grad", *names), {**kinds, **{s.name: s.shape for s in state}}, state, budget)
    return UpdateRule(dtype, state, first, step, about, digest(graph))


def digest(graph: Mapping[str, Any]) -> str:
    """The sha256 of ``graph``'s canonical JSON (sorted keys, tuples as lists)."""
    text = json.dumps(graph, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_refuse_json)
    return hashlib.sha256(text.encode()).hexdigest()


def brief(graph: Any) -> str:
    """A rule as a message shows it: its ``about`` line and the start of its digest, never
    its nodes (a traced Adam is about 10 KB of JSON)."""
    if not isinstance(graph, Mapping):
        return f"{graph!r:.80}"
    about = graph.get("about")
    about = about[:200] if isinstance(about, str) and about else "an update rule"
    try:
        return f"<{about}, sha256 {digest(graph)[:12]}>"
    except BadGraph:
        return f"<{about}, not JSON>"


def brief_args(args: Any) -> Any:
    """An optimizer's arguments as a message shows them: a ``graph`` entry (the rule of
    ``optimizer="graph"``) as :func:`brief` shows it, the others as they are."""
    if not isinstance(args, Mapping) or "graph" not in args:
        return args
    return {k: brief(v) if k == "graph" else v for k, v in args.items()}


def _refuse_json(value: Any) -> Any:
    raise BadGraph(f"update rule holds a {type(value).__name__}, which JSON cannot carry", field="graph")


def _dtype(value: Any, what: str) -> str:
    if not isinstance(value, str) or value not in DTYPES:
        raise BadGraph(f"{what} is {value!r:.60}, not one of the dtypes {', '.join(DTYPES)}", field="dtype")
    return value


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _NAME_MAX:
        raise BadGraph(f"{what} must be a non-empty name of at most {_NAME_MAX} characters, got {value!r:.60}", field="name")
    return value


def _state(value: Any) -> tuple[StateSpec, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 64:
        raise BadGraph(f"update rule field 'state' must be a list of at most 64 entries, got {value!r:.100}", field="state")
    out = []
    for entry in value:
        if not isinstance(entry, Mapping) or set(entry) != {"name", "shape", "dtype"}:
            raise BadGraph(f"a state entry must be {{name, shape, dtype}}, got {entry!r:.100}", field="state")
        name = _name(entry["name"], "a state entry's name")
        if name in ("param", "grad") or name in (s.name for s in out):
            raise BadGraph(f"state entry {name!r} is named twice or like an input (param, grad)", field="state")
        if entry["shape"] not in (PARAM, SCALAR):
            raise BadGraph(f"state entry {name!r} has shape {entry['shape']!r:.40}: it is 'param' (shaped like the parameter) or 'scalar'", field="state")
        out.append(StateSpec(name, entry["shape"], _dtype(entry["dtype"], f"state entry {name!r}'s dtype")))
    return tuple(out)


def _program(value: Any, which: str, inputs: tuple[str, ...], kinds: dict[str, str], state: Sequence[StateSpec], budget: GraphBudget) -> Program:
    if not isinstance(value, Mapping) or set(value) - {"inputs", "constants", "nodes", "outputs"}:
        raise BadGraph(f"program {which!r} must be an object of inputs, constants, nodes and outputs, got {value!r:.100}", field=which)
    got = value.get("inputs")
    if not isinstance(got, (list, tuple)) or tuple(got) != inputs:
        raise BadGraph(f"program {which!r} takes inputs {list(inputs)} (the parameter, its gradient, then its state), got {got!r:.200}", field=which)
    kinds = dict(kinds)
    constants = _constants(value.get("constants", {}), which, budget)
    for name in constants:
        if name in kinds:
            raise BadGraph(f"program {which!r}: constant {name!r} has the name of an input", field=which)
        kinds[name] = SCALAR
    raw = value.get("nodes")
    if not isinstance(raw, (list, tuple)):
        raise BadGraph(f"program {which!r}: 'nodes' must be a list", field=which)
    if len(raw) > budget.max_nodes:
        raise BadGraph(f"program {which!r} has {len(raw)} nodes, more than the budget of {budget.max_nodes}", field=which)
    nodes = tuple(_node(n, which, i, kinds, budget) for i, n in enumerate(raw))
    outs = value.get("outputs")
    want = [PARAM] + [s.shape for s in state]
    if not isinstance(outs, (list, tuple)) or len(outs) != len(want):
        raise BadGraph(
            f"program {which!r} must output {len(want)} values (the parameter, then {', '.join(s.name for s in state) or 'no state'}), got {outs!r:.200}", field=which
        )
    for i, (ref, shape) in enumerate(zip(outs, want)):
        what = "the parameter" if i == 0 else f"state {state[i - 1].name!r}"
        name = ref.get("ref") if isinstance(ref, Mapping) and set(ref) == {"ref"} else None
        if not isinstance(name, str) or name not in kinds:
            raise BadGraph(f"program {which!r}: output {i} ({what}) refers to {ref!r:.80}, which is no input, constant or node", field=which)
        if kinds[name] != shape:
            have = "the parameter's shape" if kinds[name] == PARAM else "0-d"
            raise BadGraph(f"program {which!r}: output {i} ({what}) is {name!r}, which is {have}; {what} is {'shaped like the parameter' if shape == PARAM else '0-d'}", field=which)
    return Program(inputs, constants, nodes, tuple(o["ref"] for o in outs), kinds)


def _shape(value: Any, what: str, budget: GraphBudget) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > _MAX_LIST or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise BadGraph(f"{what} has shape {value!r:.80}: a shape is a list of at most {_MAX_LIST} whole numbers >= 0", field="shape")
    numel = math.prod(value)
    if numel > budget.max_elements:
        raise BadGraph(f"{what} has shape {list(value)!r:.80} ({numel} elements): too large, the budget is {budget.max_elements}", field="shape")
    if value:
        raise BadGraph(f"{what} has shape {list(value)!r:.80}, not 0-d: a rule's tensors are shaped like the parameter or 0-d", field="shape")
    return tuple(value)


def _constants(value: Any, which: str, budget: GraphBudget) -> dict[str, Constant]:
    if not isinstance(value, Mapping):
        raise BadGraph(f"program {which!r}: 'constants' must be an object", field=which)
    if len(value) > budget.max_constants:
        raise BadGraph(f"program {which!r} has {len(value)} constants, more than the budget of {budget.max_constants}", field=which)
    out: dict[str, Constant] = {}
    total = 0
    for name, c in value.items():
        _name(name, f"program {which!r}: a constant's name")
        what = f"program {which!r}: constant {name!r}"
        if not isinstance(c, Mapping) or set(c) != {"dtype", "shape", "data"}:
            raise BadGraph(f"{what} must be {{dtype, shape, data}}, got {c!r:.100}", field=which)
        dtype = _dtype(c["dtype"], f"{what}'s dtype")
        shape = _shape(c["shape"], what, budget)
        data = c["data"]
        if not isinstance(data, str) or len(data) > 4 * budget.max_constant_bytes:
            raise BadGraph(f"{what}: 'data' must be base64 text within the budget", field=which)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadGraph(f"{what}: 'data' is not base64 ({exc})", field=which) from exc
        want = math.prod(shape) * DTYPES[dtype]
        if len(raw) != want:
            raise BadGraph(f"{what} has {len(raw)} bytes, but dtype {dtype} and shape {list(shape)} make {want}", field=which)
        total += len(raw)
        if total > budget.max_constant_bytes:
            raise BadGraph(f"program {which!r}: constants hold more than the budget of {budget.max_constant_bytes} bytes", field=which)
        out[name] = Constant(dtype, shape, raw)
    return out


def _node(value: Any, which: str, i: int, kinds: dict[str, str], budget: GraphBudget) -> Node:
    if not isinstance(value, Mapping) or not {"name", "op"} <= set(value) or set(value) - {"name", "op", "args", "kwargs", "where"}:
        raise BadGraph(f"program {which!r}: node {i} must be an object of name, op, args, kwargs and where, got {value!r:.100}", field=which)
    name = _name(value["name"], f"program {which!r}: node {i}'s name")
    op = value["op"]
    where = value.get("where", "")
    if not isinstance(where, str) or len(where) > _WHERE_MAX:
        where = ""
    at = f"program {which!r}: node {name!r}" + (f" (from {where})" if where else "")
    if not isinstance(op, str) or op not in ALLOWED_OPS:
        raise BadGraph(
            f"{at}: operator {op!r:.80} is not allowed in an update rule; a rule uses element-wise operators only "
            "(see pdps.core.updategraph.ALLOWED_OPS), so that each pserver updates its shard as the whole would be", field=which, node=name, operator=str(op)[:80],
        )
    if name in kinds:
        raise BadGraph(f"{at}: the name {name!r} is taken by an input, constant or earlier node", field=which, node=name, operator=op)
    args = value.get("args", [])
    kwargs = value.get("kwargs", {})
    if not isinstance(args, (list, tuple)) or len(args) > 8 or not isinstance(kwargs, Mapping):
        raise BadGraph(f"{at}: 'args' must be a list of at most 8 and 'kwargs' an object", field=which, node=name, operator=op)
    bad = sorted(set(kwargs) - ALLOWED_KWARGS)
    if bad:
        raise BadGraph(f"{at}: operator {op} takes no keyword {bad[0]!r:.40} in an update rule (allowed: {', '.join(sorted(ALLOWED_KWARGS))})", field=which, node=name, operator=op)
    refs: list[str] = []
    parsed_args = tuple(_arg(a, at, kinds, refs, op) for a in args)
    parsed_kwargs = {k: _arg(v, at, kinds, refs, op) for k, v in kwargs.items()}
    if op in SHAPED_FACTORIES:
        if not parsed_args:
            raise BadGraph(f"{at}: operator {op} needs a shape", field=which, node=name, operator=op)
        _shape(parsed_args[0], at, budget)
        kinds[name] = SCALAR
    elif op in LIKE_FIRST:
        if not parsed_args or not isinstance(parsed_args[0], Ref):
            raise BadGraph(f"{at}: operator {op} needs a tensor first", field=which, node=name, operator=op)
        kinds[name] = kinds[parsed_args[0].name]
    else:
        kinds[name] = PARAM if any(kinds[r] == PARAM for r in refs) else SCALAR
    return Node(name, op, parsed_args, parsed_kwargs, where)


def _arg(value: Any, at: str, kinds: Mapping[str, str], refs: list[str], op: str, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadGraph(f"{at}: a non-finite number travels as {{'float': 'inf'}}", operator=op)
        return value
    if isinstance(value, str):
        if len(value) > _MAX_TEXT:
            raise BadGraph(f"{at}: a string argument of {len(value)} characters (at most {_MAX_TEXT})", operator=op)
        return value
    if isinstance(value, (list, tuple)):
        if depth or len(value) > _MAX_LIST:
            raise BadGraph(f"{at}: a list argument must be flat and hold at most {_MAX_LIST} items, got {value!r:.80}", operator=op)
        return tuple(_arg(v, at, kinds, refs, op, depth + 1) for v in value)
    if isinstance(value, Mapping) and len(value) == 1:
        (key, inner), = value.items()
        if key == "ref":
            if not isinstance(inner, str) or inner not in kinds:
                raise BadGraph(
                    f"{at}: operator {op} refers to {inner!r:.80}, which is no input, constant or node defined before it "
                    "(a missing node, a forward reference or a cycle)", operator=op,
                )
            refs.append(inner)
            return Ref(inner)
        if key == "dtype":
            return DType(_dtype(inner, f"{at}: a dtype argument"))
        if key == "float" and inner in ("inf", "-inf", "nan"):
            return float(inner)
    raise BadGraph(f"{at}: argument {value!r:.80} is none of: number, boolean, null, string, list, {{ref}}, {{dtype}}, {{float}}", operator=op)
