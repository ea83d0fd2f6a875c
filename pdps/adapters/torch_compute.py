"""The torch adapter of the compute port: flat buffers on trainers, optimizer shards on pservers.

* :class:`TorchReplica` rebinds a user's ``nn.Module`` so every parameter is a view of
  one flat buffer and every ``.grad`` a view of one flat gradient buffer: autograd
  accumulates in place, and a block of the layout is a slice, never a copy.
* :class:`TorchShard` keeps the blocks one pserver owns in one flat tensor with the
  job's ``torch.optim`` rule over it. Only *element-wise* rules are allowed (each
  element's update depends on that element's value, gradient and state alone), so
  stepping every shard on its own is exactly stepping the whole model.
* Optimizers are named: a ``torch.optim`` class name from :data:`ELEMENTWISE`, a
  user rule by import path (``"package.module:ClassName"``) whose class declares
  ``pdps_elementwise = True``, or ``"graph"``: a rule shipped as a checked graph
  (``optimizer_args={"graph": ...}``, :mod:`pdps.adapters.torch_graph`). Their keyword arguments must be JSON-safe, because they
  travel in the job config.
"""

from __future__ import annotations

import bisect

import difflib
import functools
import importlib
import inspect
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pdps.core.errors import BadGraph, ConfigError, GradientRejected, NotReady
from pdps.core.slots import Block, ParamSpec, block_entry, parse_entry
from pdps.core.tables import TableSpec
from pdps.core.updategraph import brief_args

if TYPE_CHECKING:
    from pdps.adapters.torch_rows import TorchRows

log = logging.getLogger(__name__)

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "Rprop", "ASGD")

REFUSED = {
    "LBFGS": "it needs a closure that re-evaluates the loss and works on the whole parameter vector, "
    "which no pserver holds",
    "SparseAdam": "it takes sparse gradients only, and pdps pushes dense gradients",
    "Adafactor": "it factors the second moment over the rows and columns of each whole matrix, "
    "so a shard of rows cannot be updated on its own",
    "Muon": "it orthogonalises each whole weight matrix, so a shard of rows cannot be updated on its own",
}

# Arguments pdps cannot honour: a pserver steps outside autograd.
REFUSED_ARGS = {"differentiable": "pdps steps the optimizer outside autograd, so there is no graph to differentiate"}

# Fused kernels: one launch per step for the whole shard, on CUDA.
_FUSED_ON_CUDA = ("Adam", "AdamW", "SGD")

_USER_RULE_HELP = (
    "a user rule is named by import path 'package.module:ClassName'; the class must subclass "
    "torch.optim.Optimizer and declare pdps_elementwise = True (each pserver updates its shard "
    "independently, so only element-wise rules give the same result as updating the whole model)"
)


# --- optimizers -------------------------------------------------------------------------


def resolve_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class ``name`` names, or ConfigError saying why pdps cannot run it."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"optimizer must be a non-empty name, got {name!r}")
    if name in REFUSED:
        raise ConfigError(f"optimizer {name!r} is not supported by pdps: {REFUSED[name]}")
    if name == "graph":  # a rule shipped as a checked graph (pdps.adapters.torch_graph): nothing imported
        from pdps.adapters.torch_graph import GraphOptimizer

        return GraphOptimizer
    if name in ELEMENTWISE:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise ConfigError(f"optimizer {name!r} does not exist in torch {torch.__version__}")
        return cls
    if ":" in name or "." in name:
        return _import_rule(name)
    hint = next((f" (did you mean {a!r}?)" for a in ELEMENTWISE if a.lower() == name.lower()), "")
    raise ConfigError(
        f"unknown optimizer {name!r}{hint}; pdps runs the element-wise torch.optim rules "
        f"{', '.join(ELEMENTWISE)}, or {_USER_RULE_HELP}"
    )


def _import_rule(path: str) -> type[torch.optim.Optimizer]:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"optimizer {path!r} is not an import path; {_USER_RULE_HELP}")
    try:
        obj: Any = functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import optimizer {path!r}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer {path!r} is {obj!r}, not a torch.optim.Optimizer subclass; {_USER_RULE_HELP}")
    builtin = getattr(torch.optim, obj.__name__, None)
    if obj is builtin:  # "torch.optim.Adam" follows the rules of "Adam"
        return resolve_optimizer(obj.__name__)
    if getattr(obj, "pdps_elementwise", False) is not True:
        raise ConfigError(f"optimizer {path!r} does not declare pdps_elementwise = True; {_USER_RULE_HELP}")
    return obj


def _lists(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def _tuples(value: Any) -> Any:
    # torch.optim declares its pair arguments (betas, etas, step_sizes) as tuples.
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def optimizer_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Validate JSON-safe optimizer arguments; returns them with lists as tuples."""
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"optimizer arguments must be a mapping, got {type(kwargs).__name__}")
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise ConfigError(f"optimizer argument names must be strings, got {key!r}")
        if key in REFUSED_ARGS:
            raise ConfigError(f"optimizer argument {key!r} is not allowed: {REFUSED_ARGS[key]}")
        plain = _lists(value)
        try:
            same = json.loads(json.dumps(plain, allow_nan=False)) == plain
        except (TypeError, ValueError):
            same = False
        if not same:
            raise ConfigError(
                f"optimizer argument {key!r} = {value!r:.200} is not JSON-safe: use finite numbers, strings, "
                "booleans, null, and lists or string-keyed objects of them (it travels in the job config)"
            )
        out[key] = _tuples(plain)
    return out


def _accepts(cls: type, arg: str) -> bool:
    try:
        return arg in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def _with_kernel_choice(cls: type, kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Pick fused or foreach kernels unless the user chose."""
    if "foreach" in kwargs or "fused" in kwargs:
        return kwargs
    if device.type == "cuda" and cls is getattr(torch.optim, cls.__name__, None) and cls.__name__ in _FUSED_ON_CUDA:
        return {**kwargs, "fused": True}
    if _accepts(cls, "foreach"):
        return {**kwargs, "foreach": True}
    return kwargs


def _check_argument_names(cls: type, name: str, given: Mapping[str, Any]) -> None:
    """ConfigError for an argument the rule does not take, with the nearest one it does."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # the rule takes any name: it judges its arguments itself
    known = [n for n in params if n not in ("self", "params")]
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(known)}"
            raise ConfigError(f"optimizer {name!r} takes no argument {key!r} ({hint}); optimizer_args given: {brief_args(dict(given))}")


def _build(
    cls: type[torch.optim.Optimizer], name: str, params: Sequence[torch.Tensor], kwargs: dict[str, Any], given: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)``; a refusal is a ConfigError showing the arguments the user ``given``
    (``kwargs`` adds the kernel choice). A graph rule's refusal (BadGraph) is raised as it
    is: its message names the program, node and operator, and the rule is no argument a
    user reads."""
    try:
        return cls(list(params), **kwargs)
    except BadGraph:
        raise
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"optimizer {name!r} refused its arguments {brief_args(dict(given))}: {exc}") from exc


# --- dtypes and devices -------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"{name!r} is not a floating torch dtype")
    return dtype


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid torch device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device here")
    return dev


# --- the port -------------------------------------------------------------------------------


class TorchCompute:
    """The compute port over torch. ``device`` defaults to CUDA when there is one."""

    def __init__(self, device: str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = str(_device(device))

    @property
    def threads(self) -> int:
        """Torch's intra-op threads in this process (what a trainer computes with)."""
        return torch.get_num_threads()

    def split(self, model: Any, stages: int, *, points: Sequence[int] | None = None) -> list[Any]:
        """:func:`pdps.adapters.torch_pipeline.split` (the pipeline compute port)."""
        from pdps.adapters.torch_pipeline import split

        return split(model, stages, points=points)

    def stage_runner(
        self, module: Any, stage: int, stages: int, link: Any, loss_fn: Callable[[Any, Any], Any] | None, *, ranks: Sequence[int], timeout: float
    ) -> Any:
        """A :class:`pdps.adapters.torch_pipeline.StageRunner` (the pipeline compute port)."""
        from pdps.adapters.torch_pipeline import StageRunner

        return StageRunner(module, stage, stages, link, loss_fn, ranks=ranks, timeout=timeout)

    def check_optimizer(self, name: str, kwargs: Mapping[str, Any]) -> None:
        """ConfigError unless ``name`` is an element-wise rule that accepts ``kwargs``;
        for ``optimizer="graph"``, the rule's own :class:`~pdps.core.errors.BadGraph` (a
        ConfigError) as the checker raised it.

        Builds the rule on a one-element tensor and takes one step, so arguments torch
        only checks when stepping are caught here too.
        """
        cls = resolve_optimizer(name)
        given = optimizer_kwargs(kwargs)
        _check_argument_names(cls, name, given)
        args = _with_kernel_choice(cls, given, torch.device(self.device))
        dtype = getattr(cls, "probe_dtype", lambda _: None)(given)  # a graph rule is traced for one dtype
        dummy = torch.zeros(1, device=self.device, dtype=dtype)
        dummy.grad = torch.zeros_like(dummy)
        opt = _build(cls, name, [dummy], args, given)
        try:
            opt.step()
        except BadGraph:
            raise
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"optimizer {name!r} failed a step with arguments {brief_args(given)}: {exc}") from exc

    def replica(self, module: torch.nn.Module) -> TorchReplica:
        return TorchReplica(module, self.device)

    def tables(self, module: torch.nn.Module, options: Mapping[str, Any] | None = None) -> Any:
        from pdps.adapters.torch_tables import TorchTables

        return TorchTables(module, options)

    def tensors(self, columns: Mapping[str, Any], device: str = "cpu") -> dict[str, torch.Tensor]:
        out = {k: torch.from_numpy(v) for k, v in columns.items()}
        return out if device == "cpu" else {k: v.to(device) for k, v in out.items()}

    def shard(self, blocks: Sequence[Block], optimizer: str, optimizer_args: Mapping[str, Any]) -> TorchShard:
        self.check_optimizer(optimizer, optimizer_args)
        return TorchShard(blocks, optimizer, optimizer_args, self.device)

    def rows(
        self,
        spec: TableSpec,
        rule: str,
        args: Mapping[str, Any],
        slots: Collection[int],
        num_slots: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_ids: int | None = None,
    ) -> TorchRows:
        """The rows of table ``spec`` in ``slots`` on this device (:mod:`pdps.adapters.torch_rows`);
        ``max_ids`` None: the default of ``sparse_max_ids``."""
        from pdps.adapters.torch_rows import DEFAULT_MAX_IDS, TorchRows

        return TorchRows(spec, rule, args, slots, num_slots, clock, device=self.device, max_ids=max_ids or DEFAULT_MAX_IDS)


class TorchReplica:
    """A model bound to one flat parameter buffer and one flat gradient buffer.

    Trainable parameters are taken in ``named_parameters()`` order (tied parameters
    once); frozen ones are left alone and never sent to a pserver. The
    module is moved to ``device`` (its buffers too). After binding, ``p.data`` is a view
    of :attr:`flat_params` and ``p.grad`` a view of :attr:`flat_grads`; if user code
    replaces either (``model.zero_grad(set_to_none=True)``, ``model.to(...)``),
    :meth:`ensure_bound` puts the view back and keeps the values.
    """

    def __init__(self, module: torch.nn.Module, device: str | torch.device) -> None:
        # Frozen parameters (requires_grad=False) stay local: the pservers would move them
        # through weight decay or momentum even with zero gradients.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
        first_name, first = named[0]
        for name, p in named:
            if not p.dtype.is_floating_point:
                raise ConfigError(f"parameter {name!r} has dtype {dtype_name(p.dtype)}; pdps trains floating parameters only")
            if p.dtype != first.dtype:
                raise ConfigError(
                    f"parameter {name!r} is {dtype_name(p.dtype)} but {first_name!r} is {dtype_name(first.dtype)}: "
                    "pdps keeps the model in one flat buffer, so all parameters must share one dtype "
                    "(convert the model, e.g. model.to(torch.float32))"
                )
            if p.device != first.device:
                raise ConfigError(
                    f"parameter {name!r} is on {p.device} but {first_name!r} is on {first.device}: "
                    "all parameters must be on one device"
                )
        self.device = str(_device(device))
        self.module = module
        self.specs = [ParamSpec(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in named]
        self.numel = sum(s.numel for s in self.specs)
        self._params = [p for _, p in named]
        self.flat_params = torch.empty(self.numel, dtype=first.dtype, device=self.device)
        self.flat_grads = torch.zeros(self.numel, dtype=first.dtype, device=self.device)
        self._value_views: list[torch.Tensor] = []
        self._grad_views: list[torch.Tensor] = []
        offset = 0
        with torch.no_grad():
            for spec, p in zip(self.specs, self._params):
                n = spec.numel
                value = self.flat_params[offset : offset + n].view(spec.shape)
                value.copy_(p.detach())
                self._value_views.append(value)
                self._grad_views.append(self.flat_grads[offset : offset + n].view(spec.shape))
                offset += n
        for p, value, grad in zip(self._params, self._value_views, self._grad_views):
            p.data = value
            p.grad = grad
        module.to(self.device)  # buffers; the parameters are already there, so they stay bound

    def ensure_bound(self) -> None:
        """Re-bind any parameter or gradient user code replaced, keeping what it holds.

        A gradient set to ``None`` means zero; a replaced gradient (autograd fills a new
        one after ``set_to_none``) is copied into the view so accumulated values survive.
        """
        for p, value, grad in zip(self._params, self._value_views, self._grad_views):
            if p.data_ptr() != value.data_ptr() or p.shape != value.shape:
                if p.shape != value.shape or p.dtype != value.dtype:
                    raise ConfigError(
                        f"a parameter of shape {tuple(p.shape)} ({dtype_name(p.dtype)}) replaced the bound one "
                        f"{tuple(value.shape)} ({dtype_name(value.dtype)}): do not change the model's shapes or "
                        "dtype after handing it to pdps"
                    )
                with torch.no_grad():
                    value.copy_(p.detach())
                p.data = value
            g = p.grad
            if g is None:
                grad.zero_()
                p.grad = grad
            elif g.data_ptr() != grad.data_ptr() or g.shape != grad.shape:
                grad.copy_(g.detach())
                p.grad = grad

    def _check(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            spec = self.specs[b.index] if 0 <= b.index < len(self.specs) else None
            if spec is None or spec.name != b.param or spec.dtype != b.dtype or b.offset + b.numel > self.numel:
                raise ConfigError(f"block {b.describe()} does not belong to this model's layout")

    def grads(self, blocks: Sequence[Block]) -> list[torch.Tensor]:
        self._check(blocks)
        self.ensure_bound()
        return [self.flat_grads[b.offset : b.offset + b.numel].view(b.shape) for b in blocks]

    def values(self, blocks: Sequence[Block]) -> list[torch.Tensor]:
        self._check(blocks)
        self.ensure_bound()
        return [self.flat_params[b.offset : b.offset + b.numel].view(b.shape) for b in blocks]

    def load(self, blocks: Sequence[Block], tensors: Sequence[torch.Tensor]) -> None:
        if len(blocks) != len(tensors):
            raise ConfigError(f"load got {len(tensors)} tensors for {len(blocks)} blocks")
        self._check(blocks)
        self.ensure_bound()
        with torch.no_grad():
            for b, t in zip(blocks, tensors):
                if tuple(t.shape) != b.shape:
                    raise ConfigError(f"pulled value for {b.describe()} has shape {tuple(t.shape)}, the block is {b.shape}")
            for b, t in zip(blocks, tensors):
                dest = self.flat_params[b.offset : b.offset + b.numel]
                if t.data_ptr() != dest.data_ptr():  # not received in place already
                    dest.view(b.shape).copy_(t)

    def check_finite(self, trainer: str) -> None:
        """Raise GradientRejected naming the parameter if any gradient holds NaN or Inf.

        One reduction over the flat buffer; the per-parameter scan runs only when the sum
        is not finite (which overflow of finite values can also cause).
        """
        if bool(torch.isfinite(self.flat_grads.sum())):
            return
        for spec, g in zip(self.specs, self._grad_views):
            if not bool(torch.isfinite(g).all()):
                nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
                raise GradientRejected(
                    f"gradient of {spec.name} on trainer {trainer!r} holds {nan} NaN and {inf} infinite values; "
                    "nothing was pushed"
                )

    def on_grad_ready(self, fn: Callable[[int], None]) -> Callable[[], None]:
        """Call ``fn(i)`` as soon as backward has accumulated parameter ``i``'s gradient
        (in :attr:`specs` order), its flat-buffer view then holding it. Returns a remover."""

        def hook(i: int) -> Callable[[torch.Tensor], None]:
            p, view = self._params[i], self._grad_views[i]

            def ready(_: torch.Tensor) -> None:
                g = p.grad
                if g is not None and (g.data_ptr() != view.data_ptr() or g.shape != view.shape):
                    view.copy_(g.detach())  # user code replaced the gradient: bind it back
                    p.grad = view
                fn(i)

            return ready

        handles = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(self._params)]
        return lambda: [h.remove() for h in handles] and None

    def before_forward(self, fn: Callable[[list[int]], None]) -> Callable[[], None]:
        """Call ``fn(indices)`` before each submodule that owns trainable parameters runs
        its forward, with those parameters' indices. Returns a remover."""
        index = {id(p): i for i, p in enumerate(self._params)}
        handles = []
        for module in self.module.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if own:
                handles.append(module.register_forward_pre_hook(lambda _m, _a, own=own: fn(own)))
        return lambda: [h.remove() for h in handles] and None

    def value_blocks(self, blocks: Sequence[Block]) -> list[torch.Tensor]:
        """Views of the flat parameter buffer for ``blocks``, no re-binding: where a pull
        may be received in place (see ``Channel.call``'s ``into``)."""
        return [self.flat_params[b.offset : b.offset + b.numel].view(b.shape) for b in blocks]

    def grad_blocks(self, blocks: Sequence[Block]) -> list[torch.Tensor]:
        """Views of the flat gradient buffer for ``blocks``, as they are: no re-binding
        and no check (the pserver checks what it is pushed), safe while backward runs."""
        return [self.flat_grads[b.offset : b.offset + b.numel].view(b.shape) for b in blocks]

    def zero_blocks(self, blocks: Sequence[Block]) -> None:
        """Zero these blocks of the gradient buffer (once they have been pushed)."""
        views = self.grad_blocks(blocks)
        if views:
            torch._foreach_zero_(views)

    def load_blocks(self, blocks: Sequence[Block], tensors: Sequence[torch.Tensor]) -> None:
        """:meth:`load` without re-binding the model (safe while another thread runs it):
        the values land in the flat buffer the parameters are views of."""
        with torch.no_grad():
            for b, t in zip(blocks, tensors):
                if tuple(t.shape) != b.shape:
                    raise ConfigError(f"pulled value for {b.describe()} has shape {tuple(t.shape)}, the block is {b.shape}")
                dest = self.flat_params[b.offset : b.offset + b.numel]
                if t.data_ptr() != dest.data_ptr():  # not received in place already
                    dest.view(b.shape).copy_(t)

    def zero_grad(self) -> None:
        self.flat_grads.zero_()
        for p, grad in zip(self._params, self._grad_views):
            if p.grad is None or p.grad.data_ptr() != grad.data_ptr() or p.grad.shape != grad.shape:
                p.grad = grad


def _block_state(b: Block, entry: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The optimizer state of block ``b`` from its own entry (same cut), copied."""
    state: dict[str, Any] = {}
    for key, v in entry.items():
        kind, _, name = key.partition(".")
        if key == "values":
            continue
        if kind == "scalar":
            state[name] = v.item()
        elif v.dim() == 0:
            state[name] = v.clone()
        elif v.numel() == b.numel:
            state[name] = v.reshape(b.shape).clone()
        else:
            raise ConfigError(f"state {key!r} for {b.describe()} has {v.numel()} elements, not {b.numel}")
    return state


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces end to end; one piece as it is (a block of the same cut: no copy here)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _entries_by_param(entries: Mapping[str, torch.Tensor]) -> dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]]:
    """``<param>@<first>:<end>/<what>`` entries, grouped: param -> [(first, end, {what: tensor})]."""
    grouped: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
    for key, t in entries.items():
        name = parse_entry(key)
        if name is None or not isinstance(t, torch.Tensor):
            raise ConfigError(f"unexpected entry {key!r}: block entries are named <param>@<first>:<end>/<values|state.K|scalar.K>")
        param, first, end, what = name
        grouped.setdefault((param, first, end), {})[what] = t
    out: dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]] = {}
    for (param, lo, hi), e in grouped.items():
        out.setdefault(param, []).append((lo, hi, e))
    return out


class TorchShard:
    """The blocks one pserver owns, in one flat tensor, with the job's optimizer over it.

    Blocks are laid out in the given order. The optimizer's parameters are the blocks'
    views of that tensor, so an async push is applied by handing the optimizer the
    received tensors as gradients (no copy into a gradient buffer), and a push of some
    blocks only (a trainer pushing each slot as soon as backward has produced it)
    steps those blocks only: torch's rules skip a parameter whose ``grad`` is None.
    Sync rounds stage each trainer's gradient in a buffer of its own (float32 when the
    blocks are half precision), reused round after round, or keep the received tensors
    themselves when the caller may give them away (``keep``: no copy), and apply their
    weighted sum from one reused buffer (``values.grad``); an async step pushed in
    pieces is staged the same way and stepped straight from its buffer
    (:meth:`apply_staged_step`).
    Callers run :meth:`check` before :meth:`stage` and :meth:`apply`, which do not
    re-validate.
    """

    def __init__(
        self,
        blocks: Sequence[Block],
        optimizer: str,
        optimizer_args: Mapping[str, Any],
        device: str | torch.device = "cpu",
    ) -> None:
        self.blocks = tuple(blocks)
        dtypes = sorted({b.dtype for b in self.blocks})
        if len(dtypes) > 1:
            raise ConfigError(f"the blocks of one shard must share a dtype, got {dtypes}")
        self.dtype = torch_dtype(dtypes[0] if dtypes else "float32")
        # staged gradients are summed in this dtype: float32 for half-precision blocks
        self._sum_dtype = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype
        self.device = str(_device(device))
        self.numel = sum(b.numel for b in self.blocks)
        self.values = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        # not zeroed: each step zeroes it or copies into it before reading (a resize builds
        # shards of a large model while training goes on: a pass over memory saved)
        self._grad = torch.empty_like(self.values)
        self.values.grad = self._grad
        self._acc: torch.Tensor | None = None  # float32 sum of staged half-precision gradients
        self._staged: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._live: set[str] = set()
        self._ranges: list[tuple[int, int]] = []
        offset = 0
        for b in self.blocks:
            self._ranges.append((offset, b.numel))
            offset += b.numel
        self._value_views = self._views_of(self.values)
        self._grad_views = self._views_of(self._grad)
        self.optimizer_name = optimizer
        cls = resolve_optimizer(optimizer)
        given = optimizer_kwargs(optimizer_args)
        self.optimizer_args = _with_kernel_choice(cls, given, torch.device(self.device))
        self._all = tuple(range(len(self.blocks)))
        # per key, the staged gradient of each block staged: a view of the key's buffer, or
        # a tensor kept as received
        self._staged_blocks: dict[str, dict[int, torch.Tensor]] = {}
        # a pserver holding no blocks still builds its rule (over the empty tensor), so
        # a bad optimizer is refused the same way everywhere
        self.optimizer = _build(cls, optimizer, self._value_views or [self.values], self.optimizer_args, given)
        self.initialized = False
        self._expecting = False  # expect_import(): gradients may be staged before the values come
        log.debug("shard of %d blocks (%d elements) on %s with %s(%r)", len(self.blocks), self.numel, self.device, optimizer, self.optimizer_args)

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a : a + n].view(b.shape) for b, (a, n) in zip(self.blocks, self._ranges)]

    def _ready(self) -> None:
        if not self.initialized:
            raise NotReady("the parameters of this shard are not initialized yet")

    def _on_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to(self.device, non_blocking=True) for t in tensors]

    def check(self, tensors: Sequence[Any], trainer: str, what: str = "gradient", indices: Sequence[int] | None = None, *, finite: bool = True) -> None:
        """Shapes, dtypes and (``finite``) finiteness of ``tensors``, one per block (the
        blocks at ``indices`` when given: a push of some slots only)."""
        blocks = self.blocks if indices is None else [self.blocks[i] for i in indices]
        if len(tensors) != len(blocks):
            raise GradientRejected(
                f"{what}s from trainer {trainer!r}: got {len(tensors)} tensors for {len(blocks)} blocks "
                f"(this pserver holds {len(self.blocks)}); the trainer's layout is out of date, re-fetch it"
            )
        for b, t in zip(blocks, tensors):
            if not isinstance(t, torch.Tensor):
                raise GradientRejected(f"{what} for {b.describe()} from trainer {trainer!r} is a {type(t).__name__}, not a tensor")
            if tuple(t.shape) != b.shape:
                raise GradientRejected(
                    f"{what} for {b.describe()} from trainer {trainer!r} has shape {tuple(t.shape)} but the block is {b.shape}"
                )
            if t.dtype != self.dtype:
                raise GradientRejected(
                    f"{what} for {b.describe()} from trainer {trainer!r} has dtype {dtype_name(t.dtype)} but the block is {b.dtype}"
                )
        if not finite:
            return
        # A sum is finite only if every element is (NaN and inf propagate), and summing
        # reads each element once without writing a mask, several times cheaper than
        # isfinite(t).all(). A non-finite sum may also be overflow of finite values, so
        # only then is each block checked element by element. One host sync per device.
        sums: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            sums.setdefault(t.device, []).append(t.sum())
        if all(bool(torch.isfinite(torch.stack(ss)).all()) for ss in sums.values()):
            return
        for b, t in zip(blocks, tensors):
            if not bool(torch.isfinite(t).all()):
                nan = int(torch.isnan(t).sum())
                inf = int(torch.isinf(t).sum())
                raise GradientRejected(
                    f"{what} for {b.describe()} from trainer {trainer!r} is not finite: {nan} NaN and {inf} infinite values"
                )

    def initialize(self, tensors: Sequence[Any], trainer: str) -> None:
        """Take initial values (copied); resets optimizer state and drops staged gradients."""
        self.check(tensors, trainer, what="initial value")
        with torch.no_grad():
            for view, t in zip(self._value_views, self._on_device(tensors)):
                view.copy_(t)
        self.optimizer.state.clear()
        if self._acc is not None:
            self._acc.zero_()
        self._live.clear()
        self._staged_blocks.clear()
        self._expecting = False
        self.initialized = True

    # --- transactional sync rounds: stage per trainer, apply what the round names --------

    def stage(self, key: str, tensors: Sequence[torch.Tensor], indices: Sequence[int] | None = None, *, keep: bool = False) -> None:
        """Keep a copy of ``key``'s gradient (replacing an earlier one): for the open
        sync round, or for an async step pushed in pieces.

        ``indices`` names the blocks ``tensors`` are for (default: all, in order); a key
        is staged once every block has been (:meth:`staged`). One buffer per key,
        reused round after round: no allocation per step. ``keep``: the tensors are
        the caller's to give away (nobody writes them any more, see
        :attr:`~pdps.ports.transport.Message.owned`), so those already on this shard's
        device are kept as they are instead of copied. Half-precision blocks are always
        copied: they are summed in float32. Before the shard is initialized only after
        :meth:`expect_import`.
        """
        if not self._expecting:
            self._ready()
        at = self._all if indices is None else indices
        have = self._staged_blocks.setdefault(key, {})
        keep = keep and self._sum_dtype == self.dtype
        copy = []
        for i, t in zip(at, tensors):
            if keep and t.device == self.values.device:
                have[i] = t
            else:
                copy.append((i, t))
        if copy:
            buf = self._staged.get(key)
            if buf is None:
                flat = torch.empty(self.numel, dtype=self._sum_dtype, device=self.device)
                buf = self._staged[key] = (flat, self._views_of(flat))
            views = [buf[1][i] for i, _ in copy]
            torch._foreach_copy_(views, self._on_device([t for _, t in copy]))
            have.update(zip((i for i, _ in copy), views))
        if len(have) == len(self.blocks):
            self._live.add(key)

    def reserve(self, keys: Iterable[str]) -> None:
        """Allocate and touch the staging buffers of ``keys`` and the gradient buffer: a
        shard built ahead of a resize's switch allocates nothing in its first round."""
        for key in keys:
            if key not in self._staged:
                flat = torch.zeros(self.numel, dtype=self._sum_dtype, device=self.device)
                self._staged[key] = (flat, self._views_of(flat))
        self._grad.zero_()

    def staged(self) -> set[str]:
        """Keys whose gradient is staged for the open round."""
        return set(self._live)

    def unstage(self, key: str | None = None, *, forget: bool = False) -> None:
        """Drop ``key``'s staged gradient (every key's if None); ``forget`` frees its buffer."""
        keys = list(self._staged) if key is None else [key]
        for k in keys:
            self._live.discard(k)
            self._staged_blocks.pop(k, None)
            if forget:
                self._staged.pop(k, None)

    def apply_staged(self, weights: Sequence[tuple[str, float]]) -> None:
        """One optimizer step with gradient ``sum(w * staged[key])``, summed in the given
        order; then nothing is staged. Every key must be staged (KeyError otherwise)."""
        self._ready()
        missing = [k for k, _ in weights if k not in self._live]
        if missing:
            raise KeyError(f"no staged gradient for {missing}")
        # half-precision shards sum in float32 (the staged buffers' dtype), then round once
        acc = self._acc_buffer() if self._sum_dtype != self.dtype else self._grad
        sums = self._grad_views if acc is self._grad else self._views_of(acc)
        for n, (key, w) in enumerate(weights):
            staged = self._staged_blocks[key]
            grads = [staged[i] for i in range(len(sums))]
            if n == 0:  # w * g is 0 + w * g to the bit: no pass zeroing the sum first
                for out, g in zip(sums, grads):
                    torch.mul(g, float(w), out=out)
            else:
                torch._foreach_add_(sums, grads, alpha=float(w))
        if acc is not self._grad:
            self._grad.copy_(acc)
        self._step(self._all, self._grad_views)
        self._live.clear()
        self._staged_blocks.clear()

    def _acc_buffer(self) -> torch.Tensor:
        if self._acc is None:
            self._acc = torch.zeros(self.numel, dtype=self._sum_dtype, device=self.device)
        return self._acc

    def staged_step(self, key: str) -> tuple[list[int], list[torch.Tensor]]:
        staged = self._staged_blocks.get(key, {})
        indices = sorted(staged)
        return indices, [staged[i] for i in indices]

    def apply_staged_step(self, key: str) -> bool:
        """One optimizer step of the blocks ``key`` has staged, with its staged gradient
        as is; then ``key`` has nothing staged (other keys keep theirs). False if it has
        staged nothing."""
        self._ready()
        staged = self._staged_blocks.pop(key, {})
        self._live.discard(key)
        if not staged:
            return False
        indices = sorted(staged)
        grads = [staged[i] for i in indices]
        if grads[0].dtype != self.dtype:  # half precision stages in float32: round once, here
            views = [self._grad_views[i] for i in indices]
            torch._foreach_copy_(views, grads)
            grads = views
        self._step(indices, grads)
        return True

    def apply(self, tensors: Sequence[torch.Tensor], indices: Sequence[int] | None = None) -> None:
        """One optimizer step of the blocks at ``indices`` (default: all) with ``tensors``
        as their gradients, used in place: the caller must not change them meanwhile."""
        self._ready()
        self._step(self._all if indices is None else indices, self._on_device(tensors))

    def _step(self, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        params = self._value_views
        for i, g in zip(indices, grads):
            params[i].grad = g
        try:
            self.optimizer.step()
        finally:
            for i in indices:
                params[i].grad = None

    def views(self) -> list[torch.Tensor]:
        self._ready()
        return list(self._value_views)

    # --- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors only (safetensors-friendly): ``values``, ``state.<key>`` for each
        optimizer state tensor (the blocks' state laid end to end, as ``values``),
        ``scalar.<key>`` (0-d) for plain-number state.

        ``values`` aliases the live shard (serialize it before the next step); the state
        tensors are assembled from the blocks' own.
        """
        out = {"values": self.values.detach()}
        per_block = [self.optimizer.state.get(p, {}) for p in self._value_views]
        keys = list(dict.fromkeys(k for st in per_block for k in st))
        for key in keys:
            have = [st.get(key) for st in per_block]
            first = next(v for v in have if v is not None)
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                # a block never stepped (a push cut short by a crash) has no state yet: zeros,
                # which is what the rule starts from
                parts = [(v if v is not None else torch.zeros(b.shape, dtype=first.dtype, device=first.device)).detach().reshape(-1) for v, b in zip(have, self.blocks)]
                out[f"state.{key}"] = torch.cat(parts)
            elif isinstance(first, torch.Tensor):
                # per-block counters (Adam's step) agree unless a push was cut short; keep the largest
                out[f"state.{key}"] = max((v.detach() for v in have if v is not None), key=float).clone()
            elif isinstance(first, (bool, int, float)):
                out[f"scalar.{key}"] = torch.tensor(first)
            elif first is not None:
                raise ConfigError(f"optimizer state {key!r} is a {type(first).__name__}; pdps checkpoints tensors and numbers only")
        return out

    def export_blocks(self, indices: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """The blocks at ``indices`` (default all), keyed by block: ``<param>@<rows>/values``
        and, for each optimizer state entry, ``<param>@<rows>/state.<key>`` (a tensor:
        flat if per element, 0-d if per block) or ``<param>@<rows>/scalar.<key>`` (a
        plain number, as a 0-d tensor); ``<rows>`` is ``<first>:<end>``. The tensors
        alias the shard (copy them if it steps on). Such entries load into a shard of
        any other cut of the same parameters (:meth:`import_blocks`): checkpoints and
        slot migrations are keyed by block, not by pserver."""
        out: dict[str, torch.Tensor] = {}
        for i in self._all if indices is None else indices:
            b, view = self.blocks[i], self._value_views[i]
            name = block_entry(b)
            out[f"{name}/values"] = view.detach().reshape(-1)
            for key, v in self.optimizer.state.get(view, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"{name}/state.{key}"] = v.detach().reshape(-1) if v.dim() else v.detach()
                elif isinstance(v, (bool, int, float)):
                    out[f"{name}/scalar.{key}"] = torch.tensor(v)
                elif v is not None:
                    raise ConfigError(f"optimizer state {key!r} is a {type(v).__name__}; pdps moves and checkpoints tensors and numbers only")
        return out

    def import_blocks(self, entries: Mapping[str, torch.Tensor]) -> None:
        """Load every block of this shard from :meth:`export_blocks` entries of any cut
        of the same parameters (rows are put together from whichever entries cover
        them); the shard is then initialized. ConfigError, with nothing changed, if
        some rows of a block are in no entry, or an entry does not fit."""
        by_param = _entries_by_param(entries)
        for have in by_param.values():
            have.sort(key=lambda x: (x[0], x[1]))
        starts = {param: [lo for lo, _, _ in have] for param, have in by_param.items()}
        loaded: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for b in self.blocks:
            have = by_param.get(b.param, [])
            row = b.numel // max(1, b.row_end - b.row_start) if b.shape else 1
            parts = have[:1]
            if b.shape:  # the entries overlapping the block's rows, found by bisection (a model has many blocks)
                j = max(0, bisect.bisect_right(starts.get(b.param, []), b.row_start) - 1)
                parts = []
                while j < len(have) and have[j][0] < b.row_end:
                    if have[j][1] > b.row_start:
                        parts.append(have[j])
                    j += 1
            exact = parts[0][2] if len(parts) == 1 and (not b.shape or parts[0][:2] == (b.row_start, b.row_end)) else None
            if exact is not None and "values" in exact and exact["values"].numel() == b.numel:
                loaded.append((exact["values"], _block_state(b, exact)))  # the same cut (a migration): no slicing
                continue
            covered = b.row_start
            for lo, hi, _ in parts:
                if lo > covered:
                    break
                covered = max(covered, hi)
            if not parts or (b.shape and covered < b.row_end):
                raise ConfigError(f"no state for {b.describe()} (rows {covered}.. are in no entry): the state was saved for other parameters")

            def cut(lo: int, hi: int, t: torch.Tensor) -> torch.Tensor:
                if not b.shape:
                    return t.reshape(-1)
                a, z = max(lo, b.row_start) - lo, min(hi, b.row_end) - lo
                flat = t.reshape(-1)
                if flat.numel() != (hi - lo) * row:
                    raise ConfigError(f"an entry for {b.param}[{lo}:{hi}] has {flat.numel()} elements, not {(hi - lo) * row}")
                return flat[a * row : z * row]

            values = _joined([cut(lo, hi, e["values"]) for lo, hi, e in parts]) if all("values" in e for _, _, e in parts) else None
            if values is None or values.numel() != b.numel:
                raise ConfigError(f"no values for {b.describe()} in the entries given")
            state: dict[str, Any] = {}
            for key in dict.fromkeys(k for _, _, e in parts for k in e if k != "values"):
                kind, _, name = key.partition(".")
                given = [(lo, hi, e.get(key)) for lo, hi, e in parts]
                first = next(v for _, _, v in given if v is not None)
                if kind == "scalar":
                    state[name] = first.item()
                elif first.dim() == 0:  # a per-block counter (Adam's step): the blocks agree unless a step was cut short
                    state[name] = max((v for _, _, v in given if v is not None), key=float).clone()
                else:  # rows never stepped have no state yet: zeros, which the rule starts from
                    state[name] = _joined([cut(lo, hi, v if v is not None else torch.zeros((hi - lo) * row, dtype=first.dtype)) for lo, hi, v in given]).view(b.shape).clone()
            loaded.append((values, state))
        with torch.no_grad():
            for view, (values, state) in zip(self._value_views, loaded):
                view.copy_(values.view(view.shape))
                self.optimizer.state.pop(view, None)
                if state:
                    self.optimizer.state[view] = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        if not self._expecting:  # gradients staged while the values were on their way stay staged
            if self._acc is not None:
                self._acc.zero_()
            self._live.clear()
            self._staged_blocks.clear()
        self._expecting = False
        self.initialized = True

    def expect_import(self) -> None:
        """The values are on their way (a resize moving slots here): gradients may be
        staged before :meth:`import_blocks`, which keeps them."""
        self._expecting = True

    def snapshot(self, counters: Mapping[str, int], indices: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        state = {k: v.clone() for k, v in self.export_blocks(indices).items()}
        state.update((k, torch.tensor(n, dtype=torch.int64)) for k, n in counters.items())
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` output (copied); the shard is then initialized."""
        values = state.get("values")
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (self.numel,) or values.dtype != self.dtype:
            got = f"{tuple(values.shape)} {dtype_name(values.dtype)}" if isinstance(values, torch.Tensor) else repr(values)
            raise ConfigError(f"checkpoint values are {got}, this shard needs ({self.numel},) {dtype_name(self.dtype)}")
        opt_state: dict[str, Any] = {}
        for key, value in state.items():
            prefix, _, name = key.partition(".")
            if key == "values":
                continue
            if not isinstance(value, torch.Tensor) or not name or prefix not in ("state", "scalar"):
                raise ConfigError(f"unexpected entry {key!r} in a shard checkpoint")
            if prefix == "state" and (value.dim() == 0 or tuple(value.shape) == (self.numel,)):
                opt_state[name] = value.detach()
            elif prefix == "scalar" and value.dim() == 0:
                opt_state[name] = value.item()
            else:
                raise ConfigError(f"checkpoint entry {key!r} has shape {tuple(value.shape)}, this shard has {self.numel} elements")
        per_block: dict[int, dict[str, Any]] = {}
        if opt_state:
            for i, (b, (a, n)) in enumerate(zip(self.blocks, self._ranges)):
                per_block[i] = {
                    k: (v[a : a + n].view(b.shape).clone() if v.dim() else v.clone()) if isinstance(v, torch.Tensor) else v
                    for k, v in opt_state.items()
                }
        saved_dtypes = {k: v.dtype for k, v in opt_state.items() if isinstance(v, torch.Tensor)}
        groups = self.optimizer.state_dict()["param_groups"]
        try:
            self.optimizer.load_state_dict({"state": per_block, "param_groups": groups})
        except (KeyError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"cannot load optimizer state into {self.optimizer_name!r}: {exc}") from exc
        for p in self._value_views if opt_state else ():
            live = self.optimizer.state[p]
            for key, dtype in saved_dtypes.items():
                if live[key].dtype != dtype:  # torch casts scalar state to the parameter dtype; keep it exact
                    live[key] = live[key].to(dtype)
        with torch.no_grad():
            self.values.copy_(values)
        if self._acc is not None:
            self._acc.zero_()
        self._live.clear()
        self._staged_blocks.clear()
        self.initialized = True
