"""replace_torchtitan: the fused ops in a model that torchtitan (0.3.0) parallelized with `Module.parallelize`.

torchtitan 0.3.0 does not call torch's `parallelize_module`: each of its modules carries a `ShardingConfig`
(`_sharding_config`: per-parameter layouts, and source/destination layouts of its inputs and output), and
`Module.parallelize` shards the parameters and replaces the instance's `forward` with a closure that redistributes
the inputs, runs the module's own forward and redistributes the output. No hooks, so the other converters find
nothing. This one reads the configs (docs/adoption.md, "torchtitan"; docs/decisions/0016-torchtitan-converter.md)
and replaces, in turn, the instance's `forward` of each convertible layer; the module, its type, its Parameter
objects and its state_dict stay:

- a row-parallel `nn.Linear` (weight sharded on its input dim, output Partial on the TP axis, then redistributed to
  invariant/replicated = an all-reduce, or to sequence shards = a reduce-scatter): one `gemm_allreduce` or
  `gemm_reduce_scatter(scatter_dim=d)`;
- the column-parallel `nn.Linear`s (weight sharded on its output dim, output Shard(-1)) inside a module whose input
  redistribution is their collective: torchtitan's `GQAttention` (`wq`/`wk`/`wv` of `QKVLinear`, or the one `wqkv`
  of `FusedQKVLinear`, its flavours' default) and its `FeedForward` (`w1`/`w3`), whose inputs reach only those
  layers. The parent's input redistribution is turned off (its destination layout set to its source) and the layers
  run it fused: without sequence parallelism (invariant -> replicated: identity forward, all-reduce of the input
  gradient) each layer's backward is one `gemm_allreduce(grad, weight)`; with it (sequence shards -> replicated: an
  all-gather) the first layer to run is one `allgather_gemm(return_gathered=True)` and its siblings multiply the
  same gathered input, whose gradient is reduce-scattered once for all of them.

Both of torchtitan's SPMD backends: `spmd_types` (plain local tensors; the TP group is the "tp" axis of torchtitan's
current SPMD mesh at call time, as for its own redistributions) and `partial_dtensor` (DTensors on a 1-D TP mesh).
"""
import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._groups import group_name_of
from .._ops import allgather_gemm, gemm_allreduce, gemm_reduce_scatter
from .conversion import ReplaceReport, reported
from .reduced_input_grad import linear_with_reduced_input_grad
from .row_parallel_linear import check_algorithm

WHO = "replace_torchtitan"
TESTED_VERSION = "0.3."
TP = "tp"
# torchtitan modules whose forward hands its input to column-parallel layers only: (class name, input argument).
_FUSABLE_PARENTS = {"GQAttention": "x_BLD", "FeedForward": "x"}
# The column-parallel layers under each, by the class of the module holding them.
_COLUMN_CHILDREN = {"QKVLinear": ("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv"),
                    "FusedQKVLinear": ("qkv_linear.wqkv",), "FeedForward": ("w1", "w3")}
_MARK = "_torch_gemm_ar_fused"  # set on a converted module: what it became


def replace_torchtitan(model: nn.Module, *, algorithm: str = "auto") -> ReplaceReport:
    """Fuse the tensor-parallel collectives of a model parallelized by torchtitan's `Module.parallelize` (0.3.0:
    `set_llama3_sharding_config` and the like, `spmd_types` or `partial_dtensor` backend, sequence parallelism on or
    off) with their GEMMs, in place. Returns a ReplaceReport: the layers converted, and every other module with a
    sharding config, with the reason it was left alone (a model with nothing convertible gets only reasons). Call it
    on every rank alike, after `parallelize`. Modules converted before are not listed again."""
    check_algorithm(algorithm, WHO)
    _warn_if_untested_version()
    configured = [(name, m) for name, m in model.named_modules() if _config(m) is not None]
    if not configured:
        raise ValueError(f"{WHO}: found no module with a torchtitan sharding config that Module.parallelize applied "
                         "(call it after model.parallelize(parallel_dims))")
    # Decide everything first, agree on the decisions across ranks, then convert: a rank that converted a layer its
    # peers left alone would run the project's op where they run torchtitan's collective.
    plan: List[Tuple[str, str, Any]] = []  # (name, "parent" | "row" | "skip", children / scatter dim / reason)
    planned = set()
    for name, module in configured:
        if id(module) in planned or getattr(module, _MARK, None):
            continue
        if _is_parent(module):
            children, reason = _parent_plan(name, module)
            if reason:
                plan.append((name, "skip", reason))
                continue
            plan.append((name, "parent", children))
            planned.update(id(m) for _, m in children)
            continue
        kind, detail = _classify(module)
        if kind == "row":
            plan.append((name, "row", detail))
        elif kind != "column":  # a column layer is converted with its parent, or listed when the parent is
            plan.append((name, "skip", detail))
    plan = _agreed(plan)
    replaced: List[str] = []
    skipped: List[Tuple[str, str]] = []
    handled = set()
    for name, action, detail in plan:
        module = model.get_submodule(name)
        if action == "parent":
            _fuse_parent(module, [m for _, m in detail], algorithm)
            handled.update(id(m) for _, m in detail)
            replaced += [n for n, _ in detail]
        elif action == "row":
            _fuse_row(module, detail, algorithm)
            replaced.append(name)
        else:
            skipped.append((name, detail))
    # Column layers whose parent was not converted: named with the parent's reason.
    parent_reason = dict(skipped)
    for name, module in configured:
        if id(module) in handled or getattr(module, _MARK, None) or _classify(module)[0] != "column":
            continue
        owner = _collective_owner(model, name)
        if not owner:
            skipped.append((name, "column-parallel, and no module around it redistributes its input: the collective "
                                  "that feeds it runs elsewhere (the output layer's: at the end of the norm before "
                                  "it), not next to its GEMM"))
            continue
        why = parent_reason.get(owner, f"{type(model.get_submodule(owner)).__name__} is not a module whose input "
                                       "reaches only column-parallel layers")
        skipped.append((name, f"column-parallel; its input collective sits at {owner!r}: {why}"))
    return reported(ReplaceReport(replaced, skipped, converter=WHO,
                                  ops="gemm_allreduce / gemm_reduce_scatter / allgather_gemm"))


def _warn_if_untested_version() -> None:
    import warnings

    import torchtitan

    version = getattr(torchtitan, "__version__", "unknown")
    if not str(version).startswith(TESTED_VERSION):
        warnings.warn(f"{WHO} reads torchtitan {TESTED_VERSION}'s sharding configs and private attributes "
                      f"(_sharding_config, _parallelized); this is torchtitan {version}: check the report",
                      stacklevel=3)


def _agreed(plan: List[Tuple[str, str, Any]]) -> List[Tuple[str, str, Any]]:
    """`plan` where the ranks that hold a module made the same decision about it; a module they decided differently (a
    forward hook on one rank only, say) is left alone on every rank, with every rank's decision. A rank without the
    module (another pipeline stage) has no say. A collective over the default group: every rank calls it once."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return plan

    def summary(action, detail):
        return (action, [n for n, _ in detail] if action == "parent" else detail)

    local = {name: summary(action, detail) for name, action, detail in plan}
    everyone: List[Optional[Dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    agreed = []
    for name, action, detail in plan:
        decisions = {r: other[name] for r, other in enumerate(everyone) if name in other}
        if all(d == local[name] for d in decisions.values()):
            agreed.append((name, action, detail))
        else:
            agreed.append((name, "skip", "the ranks decide differently, so no rank converts it: " + "; ".join(
                f"rank {r}: {d[0]}" + (f" ({d[1]})" if d[0] == "skip" else "") for r, d in decisions.items())))
    return agreed


def _config(module: nn.Module):
    """The ShardingConfig that torchtitan's Module.parallelize applied to `module`, else None."""
    config = getattr(module, "_sharding_config", None)
    if config is None or not getattr(module, "_parallelized", False) or "forward" not in vars(module):
        return None
    return config


def _tp_type(layout) -> Any:
    """The SPMD type of the TP axis in a torchtitan SpmdLayout (sequence shards read from its partition spec as
    S(d)), or None."""
    if layout is None:
        return None
    for axis, kind in layout.per_axis_spmd_types().items():
        if getattr(axis, "value", axis) == TP:
            return kind
    return None


def _shard_dim(kind) -> Optional[int]:
    return kind.dim if type(kind).__name__ == "Shard" else None


def _named(kind, *names) -> bool:
    return repr(kind) in names


def _classify(module: nn.Module) -> Tuple[str, Any]:
    """("row", scatter dim or None) / ("column", None) / ("other", reason)."""
    config = _config(module)
    weight = _tp_type(config.state_shardings.get("weight"))
    out_src, out_dst = _tp_type(config.out_src_shardings), _tp_type(config.out_dst_shardings)
    if type(module).__name__ == "Embedding" or isinstance(module, nn.Embedding):
        return "other", "a vocabulary-parallel embedding: its reduction follows a lookup, not a GEMM"
    if not isinstance(module, nn.Linear):
        if "Norm" in type(module).__name__:
            return "other", "a norm: no GEMM to fuse" + (
                " (its output redistribution feeds the output layer's GEMM, which is not fused)" if out_dst else "")
        if config.local_map is not None and not config.state_shardings:
            return "other", "runs on local shards (local_map): no collective next to a GEMM"
        if config.in_dst_shardings:
            return "other", ("it redistributes its input for the layers inside it, and is not a module known to hand "
                             "that input to column-parallel layers only (torchtitan's GQAttention, "
                             "FeedForward)")
        if config.out_dst_shardings:
            return "other", "no GEMM of its own: it redistributes its output"
        return "other", "parameters or buffers only: no collective in forward"
    if _is_dtensor(module.weight) and module.weight.device_mesh.ndim != 1:
        return "other", f"its weight is on a {module.weight.device_mesh.ndim}-D mesh: only a TP-only mesh is converted"
    extra = [kind for kind in ("_forward_pre_hooks", "_forward_hooks") if getattr(module, kind)]
    if extra:
        return "other", (f"it has {', '.join(extra)}: they would see the fused forward's shard inputs and outputs "
                         "instead of torchtitan's redistributed ones")
    if weight is not None and _shard_dim(weight) in (1, -1) and _named(out_src, "P"):
        if config.in_dst_shardings:
            return "other", "row-parallel with an input redistribution of its own: not converted"
        if module.bias is not None:
            return "other", "row-parallel with a bias (torchtitan adds it per rank before the reduction)"
        if _named(out_dst, "I"):
            return "row", None
        if _named(out_dst, "R"):  # replicated with a partial gradient: its backward all-reduces it
            return "other", ("row-parallel with a replicated (R) output: its gradient is partial and needs an "
                             "all-reduce in backward, which the fused op's backward does not do")
        dim = _shard_dim(out_dst)
        if dim is not None and dim not in (-1, 2):
            return "row", dim
        return "other", f"row-parallel with output layout {out_dst!r} on the TP axis: not a reduction to fuse"
    if weight is not None and _shard_dim(weight) == 0 and _shard_dim(out_src) in (-1, 2):
        if out_dst is not None and out_dst != out_src:
            return "other", f"column-parallel with its output redistributed to {out_dst!r}: not converted"
        if config.in_dst_shardings and config.in_src_shardings:
            src, dst = (_tp_type(next(iter(d.values()))) for d in (config.in_src_shardings, config.in_dst_shardings))
            if src == dst:  # e.g. the lm_head: replicated in, no redistribution here
                return "column", None
            return "other", "column-parallel with an input redistribution of its own: not converted"
        return "column", None
    return "other", f"weight {weight!r}, output {out_src!r} -> {out_dst!r} on the TP axis: not a linear layer to fuse"


def _is_parent(module: nn.Module) -> bool:
    name = type(module).__name__
    return name in _FUSABLE_PARENTS and type(module).__module__.startswith("torchtitan.")


def _parent_plan(name: str, module: nn.Module) -> Tuple[List[Tuple[str, nn.Module]], str]:
    """The column layers under a known parent, or the reason it is left alone."""
    kind = type(module).__name__
    holder = type(module.qkv_linear).__name__ if kind == "GQAttention" else kind
    if holder not in _COLUMN_CHILDREN:
        return [], f"its projections are a {holder}: only QKVLinear and FusedQKVLinear are converted"
    config = _config(module)
    arg = _FUSABLE_PARENTS[kind]
    src = _tp_type((config.in_src_shardings or {}).get(arg))
    dst = _tp_type((config.in_dst_shardings or {}).get(arg))
    if not (_named(dst, "R") and (_named(src, "I") or _shard_dim(src) in (1,))):
        return [], f"its input redistribution on the TP axis is {src!r} -> {dst!r}, not one this converter fuses"
    children = [(f"{name}.{child}", module.get_submodule(child)) for child in _COLUMN_CHILDREN[holder]]
    for child_name, child in children:
        if _config(child) is None or _classify(child)[0] != "column":
            why = "no sharding config" if _config(child) is None else _classify(child)[1]
            return [], f"its layer {child_name!r} is not a column-parallel linear layer ({why})"
        if child.bias is not None and _shard_dim(_tp_type(_config(child).state_shardings.get("bias"))) != 0:
            return [], f"its layer {child_name!r} has a bias not sharded like its output"
    return children, ""


def _collective_owner(model: nn.Module, name: str) -> str:
    """The nearest ancestor of `name` that redistributes its input (where a column layer's collective sits)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        owner = ".".join(parts[:cut])
        config = _config(model.get_submodule(owner))
        if config is not None and config.in_dst_shardings:
            return owner
    return ""


# --- the fused forwards ---------------------------------------------------------------------------------------

def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _tp_group_name(module: nn.Module) -> Optional[str]:
    """The TP group at call time: the "tp" axis of the weight's mesh (partial_dtensor), else of torchtitan's current
    SPMD mesh (spmd_types; a weight may still be a DTensor there on a mesh without that axis, e.g. FSDP's). None
    where torchtitan itself would not redistribute (no mesh, or one rank)."""
    mesh = module.weight.device_mesh if _is_dtensor(module.weight) else None
    if mesh is None or TP not in (mesh.mesh_dim_names or ()):
        from torchtitan.distributed.spmd_types import current_spmd_mesh

        mesh = current_spmd_mesh()
    if mesh is None or TP not in (mesh.mesh_dim_names or ()) or mesh.size(mesh.mesh_dim_names.index(TP)) == 1:
        return None
    return group_name_of(mesh.get_group(TP), WHO)


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _as_input(x, like, placement_fn):
    """Wraps a local result as a DTensor (partial_dtensor backend: `like` is the DTensor weight) or returns it."""
    if not _is_dtensor(like):
        return x
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(x, like.device_mesh, (placement_fn(),), run_check=False)


def _install(module: nn.Module, kind: str, forward: Callable) -> None:
    torchtitan_forward = vars(module)["forward"]
    module.forward = functools.wraps(torchtitan_forward)(forward)
    setattr(module, _MARK, kind)


def _fuse_row(module: nn.Module, scatter_dim: Optional[int], algorithm: str) -> None:
    torchtitan_forward = vars(module)["forward"]

    def forward(x):
        group = _tp_group_name(module)
        if group is None:
            return torchtitan_forward(x)
        from_dtensor = _is_dtensor(x)
        if from_dtensor:
            from torch.distributed.tensor import Shard

            if not (len(x.placements) == 1 and x.placements[0].is_shard(x.dim() - 1)):
                x = x.redistribute(x.device_mesh, (Shard(x.dim() - 1),))
        local, weight = _local(x), _local(module.weight)
        if scatter_dim is None:
            lead = local.shape[:-1]
            flat = local if local.dim() in (2, 3) else local.reshape(-1, local.shape[-1])
            out = gemm_allreduce(flat, weight.t(), group, algorithm=algorithm).reshape(*lead, weight.shape[0])
        else:
            out = gemm_reduce_scatter(local, weight.t(), group, scatter_dim=scatter_dim, algorithm=algorithm)
        if not from_dtensor:
            return out
        from torch.distributed.tensor import Replicate, Shard

        placement = Replicate() if scatter_dim is None else Shard(scatter_dim)
        return _as_input(out, module.weight, lambda: placement)

    _install(module, "gemm_allreduce" if scatter_dim is None else "gemm_reduce_scatter", forward)


class _GatheredInput(torch.autograd.Function):
    """The gathered input for the layers after the first: forward returns the gathered tensor (already computed by
    allgather_gemm), backward reduce-scatters their summed gradient back to this rank's sequence shard."""

    @staticmethod
    def forward(ctx, shard, gathered, gather_dim, group_name):
        ctx.gather_dim, ctx.group_name = gather_dim, group_name
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        dim = ctx.gather_dim
        moved = grad.movedim(dim, 0).contiguous()
        scattered = torch.ops._c10d_functional.reduce_scatter_tensor(
            moved, "sum", torch.distributed.distributed_c10d._get_group_size_by_name(ctx.group_name), ctx.group_name)
        return torch.ops._c10d_functional.wait_tensor(scattered).movedim(0, dim), None, None, None


class _ParentState(threading.local):
    """What the column layers share during one call of their parent: that the call is on, the input the first layer
    got and, with sequence parallelism, the input gathered by it. Per thread: threads calling the model at once each
    have their own call."""

    def __init__(self):
        self.active = False
        self.input = None
        self.gathered: Optional[torch.Tensor] = None

    def reset(self, active: bool) -> None:
        self.active, self.input, self.gathered = active, None, None


def _fuse_parent(parent: nn.Module, children: List[nn.Module], algorithm: str) -> None:
    import dataclasses

    config = _config(parent)
    arg = _FUSABLE_PARENTS[type(parent).__name__]
    gather_dim = _shard_dim(_tp_type(config.in_src_shardings[arg]))  # None: no sequence parallelism
    # The layers below run the input collective fused: the parent no longer redistributes that input.
    in_dst: Dict[str, Any] = dict(config.in_dst_shardings)
    in_dst[arg] = config.in_src_shardings[arg]
    parent._sharding_config = dataclasses.replace(config, in_dst_shardings=in_dst)
    state = _ParentState()
    parent_forward = vars(parent)["forward"]

    def forward(*args, **kwargs):
        state.reset(active=True)
        try:
            return parent_forward(*args, **kwargs)
        finally:
            state.reset(active=False)

    _install(parent, "column collective in its layers", forward)
    if gather_dim is not None and type(parent).__name__ == "GQAttention":
        _split_heads_by_outputs(parent.qkv_linear)
    for child in children:
        _fuse_column(child, state, gather_dim, algorithm)


def _split_heads_by_outputs(qkv: nn.Module) -> None:
    """QKVLinear's and FusedQKVLinear's forwards split heads with their input's (batch, sequence) sizes; with the
    all-gather moved into the projections the input is this rank's sequence shard, so these forwards take the sizes
    from the projections' outputs (otherwise the same steps)."""
    if type(qkv).__name__ == "QKVLinear":
        def forward(x):
            projected = (qkv.wq(x), qkv.wk(x), qkv.wv(x))
            return tuple(t.view(t.shape[0], t.shape[1], -1, qkv.head_dim) for t in projected)
    else:
        def forward(x):
            fused = qkv.wqkv(x)  # [B, L, kv_heads * (heads_per_kv + 2) * head_dim], this rank's heads
            values = _local(fused)
            b, length = values.shape[0], values.shape[1]
            grouped = values.view(b, length, -1, qkv.r_dim, qkv.head_dim)
            parts = torch.split(grouped, [qkv.heads_per_kv, 1, 1], dim=-2)
            q, k, v = (t.reshape(b, length, -1, qkv.head_dim).contiguous() for t in parts)
            if not _is_dtensor(fused):
                return q, k, v
            from torch.distributed.tensor import DTensor

            # Heads sharded as the projection's output was (its placements on dim 2 of the 5-D view carry over).
            return tuple(DTensor.from_local(t, fused.device_mesh, fused.placements, run_check=False)
                         for t in (q, k, v))

    qkv.forward = forward
    setattr(qkv, _MARK, "heads split after the fused all-gather")


def _fuse_column(module: nn.Module, state: _ParentState, gather_dim: Optional[int], algorithm: str) -> None:
    torchtitan_forward = vars(module)["forward"]

    def forward(x):
        group = _tp_group_name(module)
        if group is None:
            return torchtitan_forward(x)
        if not state.active or (state.input is not None and x is not state.input):
            raise RuntimeError(f"{WHO}: a converted column-parallel layer was called outside its parent's forward, or "
                               "on another input than its siblings; the parent's input collective runs in these "
                               "layers, so only the parent's own forward may call them")
        state.input = x
        local, weight = _local(x), _local(module.weight)
        bias = None if module.bias is None else _local(module.bias)
        if gather_dim is None:  # replicated input: the backward all-reduce of its gradient, fused
            out = linear_with_reduced_input_grad(local, weight, bias, group, algorithm)
        elif state.gathered is None:
            out, gathered = allgather_gemm(local, weight.t(), group, gather_dim=gather_dim, bias=bias,
                                           return_gathered=True, algorithm=algorithm)
            state.gathered = _GatheredInput.apply(local, gathered, gather_dim, group)
        else:
            out = F.linear(state.gathered, weight, bias)
        from torch.distributed.tensor import Shard

        return _as_input(out, module.weight, lambda: Shard(out.dim() - 1))

    _install(module, "allgather_gemm" if gather_dim is not None else "gemm_allreduce in backward", forward)


__all__ = ["replace_torchtitan"]
