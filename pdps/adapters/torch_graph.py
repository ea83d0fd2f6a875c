"""Update rules as checked graphs, torch's side: trace an optimizer into one, run one.

* :func:`convert` traces what a ``torch.optim.Optimizer`` *instance* does to one
  parameter (a built-in such as Adam, or a user's subclass written in torch ops) with
  ``make_fx`` on fake tensors, its state as explicit inputs and outputs, into the JSON
  form of :mod:`pdps.core.updategraph`, and checks it. A rule that is not element-wise
  is refused here, naming the operator and, where torch recorded it, the user's line.
  Conversions are cached (:func:`conversion_stats`).
* :class:`GraphOptimizer` runs a checked rule: a ``torch.optim.Optimizer`` whose state
  is the rule's, so a pserver's shard steps, checkpoints and migrates it exactly as a
  named optimizer, and imports nothing of the user's. Jobs name it ``optimizer="graph"``
  with ``optimizer_args={"graph": <the rule>}``; :func:`graph_rule` makes that pair.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from pdps.core.errors import BadGraph, ConfigError
from pdps.core.updategraph import (
    ALLOWED_OPS,
    DEFAULT_BUDGET,
    FORMAT,
    PARAM,
    SCALAR,
    SCALAR_FACTORIES,
    SHAPED_FACTORIES,
    Constant,
    DType,
    GraphBudget,
    Program,
    Ref,
    UpdateRule,
    check,
)

#: the optimizer name that selects this rule runner in a job config
GRAPH = "graph"

# Operators the tracer leaves that change no value (profiler marks are dropped, the
# others stand for their input).
_IDENTITY = frozenset({"lift_fresh_copy.default", "detach.default", "detach_copy.default", "alias.default", "alias_copy.default"})
_DROPPED_KWARGS = frozenset({"device", "layout", "pin_memory", "memory_format"})
# built-in rules traced with tensor step counts (capturable) and one parameter at a time
_TRACE_FLAGS = {"foreach": False, "fused": False, "capturable": True, "differentiable": False}


# --- converting --------------------------------------------------------------------------


class _Cache:
    """Converted rules by (class, hyper-parameters, dtype); ``hits`` and ``traced`` count."""

    def __init__(self) -> None:
        self.rules: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.hits = 0
        self.traced = 0
        self.lock = threading.Lock()


_CACHE = _Cache()
_TRACE_LOCK = threading.Lock()


def conversion_stats() -> dict[str, int]:
    """How many conversions were traced and how many were answered from the cache."""
    return {"traced": _CACHE.traced, "hits": _CACHE.hits, "cached": len(_CACHE.rules)}


def graph_rule(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None = None) -> tuple[str, dict[str, Any]]:
    """``(optimizer, optimizer_args)`` settings that run ``optimizer``'s rule on the
    pservers as a checked graph: ``("graph", {"graph": convert(optimizer)})``."""
    return GRAPH, {"graph": convert(optimizer, dtype)}


def convert(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The JSON update rule of ``optimizer`` (its hyper-parameters baked in) for
    parameters of ``dtype`` (default: its first parameter's).

    Traces one step on a block with no state (program ``first``) and one on a block
    with state (``step``). All parameter groups must share their hyper-parameters.
    Raises :class:`~pdps.core.errors.BadGraph` for an operator that is not element-wise
    (naming it and the user's source line where torch recorded one), ConfigError for
    an optimizer that cannot be traced. The same class, hyper-parameters and dtype are
    traced once (:func:`conversion_stats`); the result is a fresh copy each time.
    Tracing sets torch's default dtype and its compiling flag for its duration (one
    conversion at a time): convert before other threads make tensors.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"convert takes a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
    cls = type(optimizer)
    hyper = _hyper(optimizer)
    if dtype is None:
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        dtype = first.dtype if first is not None else torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise ConfigError(f"an update rule is traced for floating parameters, got {dtype}")
    key = (cls.__module__, cls.__qualname__, id(cls), json.dumps(hyper, sort_keys=True, default=repr), str(dtype))
    with _CACHE.lock:
        cached = _CACHE.rules.get(key)
        if cached is not None:
            _CACHE.hits += 1
            return json.loads(json.dumps(cached))
    with _TRACE_LOCK:  # tracing flips torch's process-wide default dtype and compiling flag
        rule = _trace_rule(optimizer, cls, hyper, dtype)
    with _CACHE.lock:
        _CACHE.rules[key] = rule
        _CACHE.traced += 1
    return json.loads(json.dumps(rule))


def _hyper(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for g in groups[1:]:
        if _plain(g) != _plain(groups[0]):
            raise ConfigError(
                f"{type(optimizer).__name__} has parameter groups with different hyper-parameters ({_plain(groups[0])} and {_plain(g)}); "
                "pdps applies one rule to every parameter: use one group"
            )
    return _plain(groups[0]) if groups else {}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"a hyper-parameter is a tensor of {value.numel()} elements; an update rule bakes in numbers only")
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _fresh(cls: type[torch.optim.Optimizer], optimizer: torch.optim.Optimizer, hyper: Mapping[str, Any], p: torch.Tensor) -> torch.optim.Optimizer:
    """A new instance of ``cls`` over ``p`` with ``hyper`` in its one group, the built-in
    flags set for tracing one tensor at a time with tensor step counts."""
    try:
        params = inspect.signature(cls.__init__).parameters
        takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in params.values())
        kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in params}
        new = cls([p], **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot make a {cls.__name__} from its defaults {optimizer.defaults} to trace it: {exc}") from exc
    group = new.param_groups[0]
    group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in hyper.items()})
    for flag, value in _TRACE_FLAGS.items():
        if flag in group:
            group[flag] = value
    return new


@contextlib.contextmanager
def _tracing(dtype: torch.dtype) -> Iterator[None]:
    # Built-in rules check `capturable` devices unless compiling, and make their step
    # counts in the default dtype: trace as torch.export does, counts in float64 for
    # float64 parameters (bias corrections then as exact as the named path's).
    old_flag = torch.compiler._is_compiling_flag
    old_default = torch.get_default_dtype()
    torch.compiler._is_compiling_flag = True
    torch.set_default_dtype(torch.float64 if dtype == torch.float64 else torch.float32)
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old_flag
        torch.set_default_dtype(old_default)


def _trace_rule(optimizer: torch.optim.Optimizer, cls: type[torch.optim.Optimizer], hyper: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import functionalize

    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if register is not None:  # keep the frames of the user's step in the nodes' stack traces
        register(inspect.unwrap(cls.step))
    shape = (3,)
    with _tracing(dtype):
        probe = torch.zeros(shape, dtype=dtype)
        opt = _fresh(cls, optimizer, hyper, probe)
        probe.grad = torch.ones_like(probe)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - any failure of a user's rule is reported as a refusal
            raise ConfigError(f"{cls.__name__} failed a step on a probe tensor: {type(exc).__name__}: {exc}") from exc
        state = []
        for name, v in opt.state[probe].items():
            if not isinstance(name, str):
                raise ConfigError(f"{cls.__name__}'s state has a key {name!r}; state keys must be strings")
            if not isinstance(v, torch.Tensor):
                raise ConfigError(
                    f"{cls.__name__}'s state entry {name!r} is a {type(v).__name__}; an update rule keeps its state in tensors "
                    f"(e.g. torch.tensor(0.0) for a count)"
                )
            if v.dim() == 0:
                kind = SCALAR
            elif tuple(v.shape) == shape:
                kind = PARAM
            else:
                raise ConfigError(f"{cls.__name__}'s state entry {name!r} has shape {tuple(v.shape)}; state is shaped like the parameter or 0-d")
            state.append({"name": name, "shape": kind, "dtype": str(v.dtype).removeprefix("torch.")})
        names = [s["name"] for s in state]
        start = [v.detach().clone() for v in opt.state[probe].values()]

        def run(first: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
            def fn(param: torch.Tensor, grad: torch.Tensor, *st: torch.Tensor) -> tuple[torch.Tensor, ...]:
                o = _fresh(cls, optimizer, hyper, param)
                if not first:
                    o.state[param] = dict(zip(names, st))
                param.grad = grad
                o.step()
                have = o.state[param]
                missing = [n for n in names if n not in have]
                if missing:
                    raise ConfigError(f"{cls.__name__} dropped state {missing} in a step; an update rule keeps the same state entries")
                return (param, *[have[n] for n in names])

            return fn

        programs = {}
        for which, first in (("first", True), ("step", False)):
            args = [torch.zeros(shape, dtype=dtype), torch.ones(shape, dtype=dtype)] + ([] if first else [t.clone() for t in start])
            try:
                gm = make_fx(functionalize(run(first), remove="mutations_and_views"), tracing_mode="fake", record_stack_traces=True)(*args)
            except (BadGraph, ConfigError):
                raise
            except Exception as exc:  # noqa: BLE001 - data-dependent Python (x.item() in a branch) and the like
                raise ConfigError(
                    f"cannot trace {cls.__name__}.step into an update rule: {type(exc).__name__}: {str(exc)[:400]} "
                    "(a rule must compute with torch operators only, without reading tensor values into Python)"
                ) from exc
            inputs = ["param", "grad"] + ([] if first else names)
            programs[which] = _program_json(gm, inputs, cls.__name__)
    about = f"{cls.__module__}.{cls.__qualname__}({', '.join(f'{k}={v!r}' for k, v in sorted(hyper.items()) if k not in _TRACE_FLAGS)})"
    rule = {"format": FORMAT, "dtype": str(dtype).removeprefix("torch."), "state": state, **programs, "about": about[:1000]}
    check(rule)  # what a pserver would refuse is refused here, with the same message
    return rule


def _op_name(target: Any) -> tuple[str, str]:
    """(namespace, ``packet.overload``) of an fx call target."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return "", getattr(target, "__name__", repr(target))
    ns, _, packet = schema.name.partition("::")
    return ns, f"{packet}.{target._overloadname}"


def _where(node: Any) -> str:
    """The last ``File ..., line N`` of a node's recorded stack trace, with its code."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(trace) - 1, -1, -1):
        line = trace[i].strip()
        if line.startswith("File "):
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            return f"{line}: {code}"[:400]
    return ""


def _program_json(gm: torch.fx.GraphModule, inputs: list[str], owner: str) -> dict[str, Any]:
    names: dict[Any, str] = {}
    constants: dict[str, Any] = {}
    nodes: list[dict[str, Any]] = []
    outputs: list[dict[str, str]] = []
    placeholders = iter(inputs)

    def arg(value: Any, at: str, op: str) -> Any:
        if isinstance(value, torch.fx.Node):
            if value not in names:
                raise BadGraph(f"{owner}: node {at} uses {value.name}, which the rule has no value for", operator=op)
            return {"ref": names[value]}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, float) and not math.isfinite(value):
            return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, (list, tuple)):
            return [arg(v, at, op) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise BadGraph(f"{owner}: node {at} ({op}) takes an argument {value!r:.80} an update rule cannot carry", operator=op)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            names[node] = next(placeholders)
        elif node.op == "get_attr":
            t = getattr(gm, node.target)
            if not isinstance(t, torch.Tensor) or t.dim() != 0:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BadGraph(f"{owner}: the rule holds a constant of shape {shape} ({_where(node) or node.name}); constants of a rule are 0-d", node=node.name)
            data = t.detach().cpu().reshape(1).view(torch.uint8).numpy().tobytes()
            constants[node.name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": [], "data": base64.b64encode(data).decode()}
            names[node] = node.name
        elif node.op == "call_function":
            ns, op = _op_name(node.target)
            if ns == "profiler":
                continue
            if op in _IDENTITY:
                names[node] = names[node.args[0]]
                continue
            if op == "copy_.default" and node.args[0].op == "placeholder":
                continue  # functionalize writes results back into the inputs: the outputs carry them
            where = _where(node)
            if op not in ALLOWED_OPS or ns != "aten":
                at = f" at {where}" if where else ""
                why = _why_refused(op)
                raise BadGraph(
                    f"{owner}.step uses operator {ns}.{op}{at}, which is not allowed in an update rule: {why}. "
                    "A rule sent to the pservers may use element-wise torch operators only (see docs/graph.md)",
                    node=node.name, operator=f"{ns}.{op}",
                )
            kwargs = {k: arg(v, node.name, op) for k, v in node.kwargs.items() if k not in _DROPPED_KWARGS}
            entry: dict[str, Any] = {"name": node.name, "op": op, "args": [arg(a, node.name, op) for a in node.args], "kwargs": kwargs}
            if where:
                entry["where"] = where
            nodes.append(entry)
            names[node] = node.name
        elif node.op == "output":
            for value in node.args[0]:
                if not isinstance(value, torch.fx.Node):
                    raise BadGraph(f"{owner}: the step returns {value!r:.60} where a tensor goes")
                outputs.append({"ref": names[value]})
        else:
            raise BadGraph(f"{owner}: the trace holds a {node.op} node ({node.target}), which an update rule cannot carry")
    return {"inputs": inputs, "constants": constants, "nodes": nodes, "outputs": outputs}


_REDUCTIONS = ("norm", "sum", "mean", "max.default", "min.default", "amax", "amin", "prod", "std", "var", "dot", "argmax", "argmin", "all", "any")


def _why_refused(op: str) -> str:
    if any(op.startswith(r) or f"_{r}" in op for r in _REDUCTIONS):
        return "it reduces over the whole tensor (a norm, sum or mean: global clipping and the like), which no pserver can do on its shard alone"
    if op.startswith(("sort", "topk", "kthvalue", "median")):
        return "it orders elements across the tensor, which a shard cannot see"
    if op.startswith(("mm", "bmm", "matmul", "addmm", "linear")):
        return "a matrix product mixes elements across the tensor"
    if op.startswith(("view", "reshape", "permute", "transpose", "t.", "expand", "slice", "select", "index", "cat", "stack", "flip", "roll")):
        return "it moves elements across the tensor, so a shard's result would differ from the whole's"
    if op.startswith("_local_scalar_dense"):
        return "it reads a tensor's value into Python (.item()), so the rule's control flow would depend on data"
    if op.split(".")[0].endswith("_") and not op.startswith("_"):
        return "it writes in place (a rule is traced functionally, so this is an operator torch could not functionalize)"
    return "it is not on the allowlist of element-wise operators"


# --- running -------------------------------------------------------------------------------


def _aten(op: str) -> Any:
    packet, _, overload = op.partition(".")
    fn = getattr(getattr(torch.ops.aten, packet, None), overload, None)
    if fn is None:
        raise BadGraph(f"operator {op!r} does not exist in torch {torch.__version__}", operator=op)
    return fn


def _aten_out(op: str) -> Any:
    """The ``out=`` overload taking the same arguments as ``op``, or None."""
    packet, _, overload = op.partition(".")
    holder = getattr(torch.ops.aten, packet)
    sig = [(a.name, str(a.type)) for a in getattr(holder, overload)._schema.arguments]
    for name in holder.overloads():
        cand = getattr(holder, name)
        args = cand._schema.arguments
        if sum(a.is_out for a in args) == 1 and [(a.name, str(a.type)) for a in args if not a.is_out] == sig:
            return cand
    return None


_DTYPES = {name: getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")}


def _constant(c: Constant, device: torch.device) -> torch.Tensor:
    t = torch.frombuffer(bytearray(c.data), dtype=torch.uint8).view(_DTYPES[c.dtype]).reshape(c.shape)
    return t.to(device)


@attrs.define
class _Step:
    fn: Any
    out_fn: Any  # the out= overload (None: the operator has none, or its result is 0-d)
    slot: int
    bind: Callable[[list[Any]], tuple[list[Any], dict[str, Any]]]
    drop: list[int]  # slots whose last use this is
    candidates: list[int]  # parameter-shaped arguments dead after this node, that are not outputs
    name: str
    dtype: torch.dtype | None = None  # of the result, learnt on the first run


class CompiledProgram:
    """A checked :class:`~pdps.core.updategraph.Program` bound to torch operators on a
    device: ``run(*inputs)`` returns its outputs (the new parameter, then its state).

    It writes into no input but those named ``writable`` (a pserver's parameter block and
    its state: the rule then updates them in place, as torch's optimizers do): a
    parameter-shaped result goes, through the operator's ``out=`` form, into an argument
    no later node reads (a writable input or an intermediate) or into an intermediate
    freed earlier in the run, so a step allocates about what an eager step does.
    """

    def __init__(self, program: Program, device: str | torch.device, where: str) -> None:
        self.program = program
        self.device = torch.device(device)
        self.where = where
        slot = {name: i for i, name in enumerate(program.inputs)}
        self._consts: list[tuple[int, torch.Tensor]] = []
        for name, c in program.constants.items():
            slot[name] = len(slot)
            self._consts.append((slot[name], _constant(c, self.device)))
        self._first_node = len(slot)
        for node in program.nodes:
            slot[node.name] = len(slot)
        last: dict[int, int] = {}
        for i, node in enumerate(program.nodes):
            for r in _refs(node):
                last[slot[r]] = i
        outs = {slot[o] for o in program.outputs}
        self._param_shaped = {slot[n] for n, k in program.kinds.items() if k == PARAM and n in slot}
        self._size = len(slot)
        self._inputs = len(program.inputs)
        self._out = [slot[o] for o in program.outputs]
        self._steps: list[_Step] = []
        for i, node in enumerate(program.nodes):
            drop = [s for s, at in last.items() if at == i and s not in outs and (s < self._inputs or s >= self._first_node)]
            param_shaped = program.kinds[node.name] == PARAM
            # copy's out= form copies self into out before src: out must not be src, so no out= for it
            out_fn = _aten_out(node.op) if param_shaped and node.op != "copy.default" else None
            args = [slot[r] for r in _refs(node)]
            candidates = [s for s in dict.fromkeys(args) if s in self._param_shaped and last.get(s) == i and s not in outs]
            self._steps.append(_Step(_aten(node.op), out_fn, slot[node.name], self._binder(node, slot), drop, candidates, node.name))

    def _binder(self, node: Any, slot: Mapping[str, int]) -> Callable[[list[Any]], tuple[list[Any], dict[str, Any]]]:
        def bind(value: Any) -> Callable[[list[Any]], Any]:
            if isinstance(value, Ref):
                i = slot[value.name]
                return lambda env: env[i]
            if isinstance(value, DType):
                d = _DTYPES[value.name]
                return lambda env: d
            if isinstance(value, tuple):
                parts = [bind(v) for v in value]
                return lambda env: [p(env) for p in parts]
            return lambda env: value

        args = [bind(a) for a in node.args]
        kwargs = {k: bind(v) for k, v in node.kwargs.items()}
        if node.op in SHAPED_FACTORIES or node.op in SCALAR_FACTORIES:
            device = self.device
            kwargs["device"] = lambda env: device

        def call(env: list[Any]) -> tuple[list[Any], dict[str, Any]]:
            return [a(env) for a in args], {k: v(env) for k, v in kwargs.items()}

        return call

    def run(self, *inputs: torch.Tensor, writable: Sequence[int] = ()) -> list[torch.Tensor]:
        """The outputs for ``inputs`` (in :attr:`Program.inputs` order); the inputs at the
        positions ``writable`` may be written into, the others are left as they are."""
        env: list[Any] = [None] * self._size
        env[: len(inputs)] = inputs
        for i, t in self._consts:
            env[i] = t
        mine = set(writable)  # slots whose storage this run may write
        free: list[torch.Tensor] = []  # parameter-shaped intermediates no node reads any more
        for step in self._steps:
            args, kwargs = step.bind(env)
            dest = None
            if step.out_fn is not None and step.dtype is not None:
                for s in step.candidates:
                    t = env[s]
                    if (s >= self._first_node or s in mine) and t.dtype == step.dtype and t.device == self.device:
                        dest = t
                        break
                if dest is None:
                    dest = next((t for t in free if t.dtype == step.dtype and t.shape == inputs[0].shape), None)
                    if dest is not None:
                        free = [t for t in free if t is not dest]
            try:
                result = step.fn(*args, **kwargs) if dest is None else step.out_fn(*args, **kwargs, out=dest)
            except (TypeError, RuntimeError, ValueError, IndexError) as exc:
                raise BadGraph(f"update rule {self.where}: node {step.name!r} failed: {exc}", node=step.name) from exc
            if step.dtype is None and isinstance(result, torch.Tensor):
                step.dtype = result.dtype
            env[step.slot] = result
            for d in step.drop:
                t, env[d] = env[d], None
                if d >= self._first_node and d in self._param_shaped and t is not result and isinstance(t, torch.Tensor):
                    free.append(t)
        return [env[i] for i in self._out]


def _refs(node: Any) -> Iterator[str]:
    for v in (*node.args, *node.kwargs.values()):
        if isinstance(v, Ref):
            yield v.name
        elif isinstance(v, tuple):
            yield from (x.name for x in v if isinstance(x, Ref))


_CHECKED: dict[str, UpdateRule] = {}
_CHECKED_LOCK = threading.Lock()


def checked(graph: Any, budget: GraphBudget = DEFAULT_BUDGET) -> UpdateRule:
    """:func:`pdps.core.updategraph.check`, remembered by digest (a pserver checks its rule
    each time it builds a shard)."""
    from pdps.core.updategraph import digest

    if not isinstance(graph, Mapping):
        return check(graph, budget)
    key = digest(graph)
    with _CHECKED_LOCK:
        rule = _CHECKED.get(key)
    if rule is None:
        rule = check(graph, budget)
        with _CHECKED_LOCK:
            if len(_CHECKED) > 64:
                _CHECKED.clear()
            _CHECKED[key] = rule
    return rule


class GraphOptimizer(torch.optim.Optimizer):
    """Runs a checked update rule (``graph``: its JSON) on each parameter with a gradient.

    The state of a parameter is the rule's state entries, as tensors, in
    ``self.state[p]``: ``state_dict``/``load_state_dict`` and pdps's shard checkpoints
    treat it as any torch optimizer's. The rule is checked when the optimizer is made,
    then run once on a probe tensor (``first`` then ``step``) so a rule whose operators
    refuse their arguments, or whose outputs have other dtypes than its state says, is
    refused here (:class:`~pdps.core.errors.BadGraph`) and not in the middle of a step.
    """

    def __init__(self, params: Any, graph: Mapping[str, Any]) -> None:
        self.rule = checked(_lists(graph))
        super().__init__(params, {})
        for group in self.param_groups:
            for p in group["params"]:
                # (a pserver holding no blocks builds its rule over an empty tensor of any dtype)
                if p.numel() and str(p.dtype).removeprefix("torch.") != self.rule.dtype:
                    raise BadGraph(
                        f"update rule {self.rule.about or self.rule.digest[:12]} was traced for {self.rule.dtype} parameters, "
                        f"this one is {str(p.dtype).removeprefix('torch.')}: convert it with the model's dtype", field="dtype",
                    )
        self._compiled: dict[torch.device, tuple[CompiledProgram, CompiledProgram]] = {}
        # a step writes the parameter and its state in place (input 1, the gradient, never)
        self._writable = (0, *range(2, 2 + len(self.rule.state)))
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        self._probe(device)

    @staticmethod
    def probe_dtype(kwargs: Mapping[str, Any]) -> torch.dtype | None:
        """The dtype the rule in ``kwargs`` was traced for (what a check steps a probe in)."""
        graph = kwargs.get("graph") if isinstance(kwargs, Mapping) else None
        name = graph.get("dtype") if isinstance(graph, Mapping) else None
        return _DTYPES.get(name) if isinstance(name, str) and name in ("float64", "float32", "float16", "bfloat16") else None

    def _programs(self, device: torch.device) -> tuple[CompiledProgram, CompiledProgram]:
        have = self._compiled.get(device)
        if have is None:
            have = self._compiled[device] = (
                CompiledProgram(self.rule.first, device, "(first)"),
                CompiledProgram(self.rule.step, device, "(step)"),
            )
        return have

    def _probe(self, device: torch.device) -> None:
        dtype = _DTYPES[self.rule.dtype]
        p = torch.zeros(2, dtype=dtype, device=device)
        g = torch.full((2,), 0.5, dtype=dtype, device=device)
        first, step = self._programs(device)
        outs = self._checked_outputs(first.run(p, g), p, "first")
        self._checked_outputs(step.run(p, g, *outs[1:]), p, "step")

    def _checked_outputs(self, outs: list[torch.Tensor], p: torch.Tensor, which: str) -> list[torch.Tensor]:
        specs = [("the parameter", PARAM, self.rule.dtype)] + [(f"state {s.name!r}", s.shape, s.dtype) for s in self.rule.state]
        for t, (what, shape, dtype) in zip(outs, specs):
            got = str(t.dtype).removeprefix("torch.")
            want_shape = tuple(p.shape) if shape == PARAM else ()
            if got != dtype or tuple(t.shape) != want_shape:
                raise BadGraph(
                    f"update rule program {which!r} makes {what} {got} of shape {tuple(t.shape)}; the rule says {dtype} of shape {want_shape}",
                    field=which,
                )
        return outs

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("a graph update rule takes no closure")
        names = [s.name for s in self.rule.state]
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                first, step = self._programs(p.device)
                st = self.state[p]
                if st:
                    outs = step.run(p, grad, *[st[n] for n in names], writable=self._writable)
                else:
                    outs = self._checked_outputs(first.run(p, grad, writable=(0,)), p, "first")
                if outs[0] is not p:
                    p.copy_(outs[0])
                for n, t in zip(names, outs[1:]):
                    st[n] = t


def _lists(value: Any) -> Any:
    """Tuples (optimizer arguments arrive with lists made tuples) back to lists."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _lists(v) for k, v in value.items()}
    return value


def run_rule(rule: UpdateRule, param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One step of ``rule`` on one tensor, functionally: ``first`` when ``state`` is None,
    else ``step``; returns the new parameter then the new state (nothing is written in place)."""
    first, step = CompiledProgram(rule.first, param.device, "(first)"), CompiledProgram(rule.step, param.device, "(step)")
    return first.run(param, grad) if state is None else step.run(param, grad, *state)
