"""Taking over an nn.Linear that torch.distributed.tensor.parallel.RowwiseParallel, or transformers' own
RowwiseParallel (`tp_plan`), parallelized (DTensor).

RowwiseParallel stores nothing on the module: `distribute_module` turns weight into a Shard(1) DTensor and bias into
a Replicate DTensor, and installs a forward pre-hook and a forward hook, lambdas over `functools.partial`s of
`RowwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, ...)` and
`RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, ...)` plus the device mesh. The layouts are
read back from those closures. torch.distributed.tensor takes seconds to import, so it is never imported here
just to look: if the user has not imported it, no module can hold a DTensor or RowwiseParallel's hooks.

transformers (5.x, `transformers.distributed.tensor_parallel`) installs no hooks: `TensorParallelLayer.install_forward`
replaces the instance's `forward` by a closure `tp_forward` over the style object (`self`), the `mesh`, the `module`
and its `original_forward`. Its RowwiseParallel keeps `input_layouts`, `output_layouts` and `use_local_output` on the
style object, with the meaning of torch's (its Replicate output is an all_reduce, the bias added once after it).
"""
import functools
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .._ops import gemm_allreduce, gemm_reduce_scatter
from ._add_norm import add_rmsnorm_after_reduction, check_norm
from .row_parallel_linear import check_algorithm


@dataclass(frozen=True)
class RowwiseLayouts:
    """What RowwiseParallel recorded for one module: its mesh and its input/output handling."""

    mesh: Any  # DeviceMesh
    input_layouts: Tuple[Any, ...]
    output_layouts: Tuple[Any, ...]
    use_local_output: bool


def _closure_values(hook) -> List[Any]:
    values = []
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return values


def _rowwise_partial(hook, fn) -> Optional[Tuple[functools.partial, Any]]:
    """(partial, mesh) if `hook` is distribute_module's lambda around a partial of `fn`, else None."""
    from torch.distributed.device_mesh import DeviceMesh

    values = _closure_values(hook)
    partial = next((v for v in values if isinstance(v, functools.partial) and v.func is fn), None)
    mesh = next((v for v in values if isinstance(v, DeviceMesh)), None)
    if partial is None or mesh is None:
        return None
    return partial, mesh


def read_transformers_style(module: nn.Module) -> Optional[Tuple[Any, Any]]:
    """(style, mesh) if transformers' TensorParallelLayer.install_forward replaced `module.forward`, else None."""
    forward = module.__dict__.get("forward")
    code, closure = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    tp = sys.modules.get("transformers.distributed.tensor_parallel")
    if tp is None or code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure))
    try:
        style, mesh, target = (cells[name].cell_contents for name in ("self", "mesh", "module"))
    except (KeyError, ValueError):  # another closure, or an empty cell
        return None
    if not isinstance(style, tp.TensorParallelLayer) or target is not module:
        return None
    return style, mesh


def transformers_layouts(module: nn.Module, others: List[str], style_name: str) -> Optional[RowwiseLayouts]:
    """The layouts of transformers' `style_name` (RowwiseParallel or ColwiseParallel) on `module`, if that is its
    style; a forward that was wrapped again on top of transformers' own (the replacement would drop it) goes into
    `others`."""
    found = read_transformers_style(module)
    tp = sys.modules.get("transformers.distributed.tensor_parallel")
    if found is None or not isinstance(found[0], getattr(tp, style_name)):
        return None
    style, mesh = found
    original = dict(zip(module.forward.__code__.co_freevars, module.forward.__closure__))["original_forward"]
    original = original.cell_contents
    if getattr(original, "__func__", None) is not type(module).forward or original.__self__ is not module:
        others.append(f"a forward wrapper {getattr(original, '__qualname__', original)!r} under transformers' own")
    return RowwiseLayouts(mesh, (style.input_layouts,), (style.output_layouts,), bool(style.use_local_output))


def read_style_hooks(module: nn.Module, style_name: str) -> Tuple[Optional[RowwiseLayouts], List[str], bool]:
    """(layouts, other_hooks) for torch's `style_name` (RowwiseParallel or ColwiseParallel: both install a pre-hook
    over partial(_prepare_input_fn, input_layouts, desired_input_layouts) and a hook over
    partial(_prepare_output_fn, output_layouts, use_local_output)): the layouts if both hooks are on `module`, else
    None; other_hooks describes every forward hook that is not the style's (a replacement would lose them); the
    last value says whether either of the style's hooks was found."""
    style = sys.modules.get("torch.distributed.tensor.parallel.style")
    cls = getattr(style, style_name, None) if style is not None else None
    input_fn = cls._prepare_input_fn if cls is not None else None
    output_fn = cls._prepare_output_fn if cls is not None else None
    pre, post, others = None, None, []
    for hook in module._forward_pre_hooks.values():
        found = _rowwise_partial(hook, input_fn) if input_fn is not None else None
        if found is not None and pre is None:
            pre = found
        else:
            others.append(f"forward pre-hook {getattr(hook, '__qualname__', hook)!r}")
    for hook in module._forward_hooks.values():
        found = _rowwise_partial(hook, output_fn) if output_fn is not None else None
        if found is not None and post is None:
            post = found
        else:
            others.append(f"forward hook {getattr(hook, '__qualname__', hook)!r}")
    if pre is None or post is None:
        return None, others, pre is not None or post is not None
    (pre_partial, mesh), (post_partial, _) = pre, post
    input_layouts, _desired = pre_partial.args
    output_layouts, use_local_output = post_partial.args
    return RowwiseLayouts(mesh, tuple(input_layouts), tuple(output_layouts), bool(use_local_output)), others, True


def read_rowwise_hooks(module: nn.Module) -> Tuple[Optional[RowwiseLayouts], List[str]]:
    """(layouts, other_hooks): the layouts if RowwiseParallel's two hooks (torch) or transformers' RowwiseParallel
    forward are on `module`, else None; other_hooks describes every forward hook that is not RowwiseParallel's
    (they would be lost by a replacement)."""
    layouts, others, found = read_style_hooks(module, "RowwiseParallel")
    if not found:
        layouts = transformers_layouts(module, others, "RowwiseParallel")
    return layouts, others


def is_dtensor(t) -> bool:
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    return dtensor_module is not None and isinstance(t, dtensor_module.DTensor)


def sequence_shard_dim(layouts: Tuple[Any, ...]) -> Optional[int]:
    """The dim of a single Shard(d) layout that shards rows (the sequence), not the last (feature) dim; else None."""
    if len(layouts) != 1 or not layouts[0].is_shard() or layouts[0].dim == -1:
        return None
    return layouts[0].dim


def rowwise_problems(module: nn.Module, layouts: Optional[RowwiseLayouts], other_hooks: List[str],
                     group_name: Optional[str], *, reduce_scatter: bool = False) -> List[str]:
    """Why `module` cannot be replaced by a DTensorRowParallelLinear (empty list: it can). reduce_scatter: the
    sequence-parallel form (output_layouts=Shard(d) on a row dim: gemm_reduce_scatter) instead of Replicate()."""
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(module, nn.Linear):
        kind = type(module).__name__
        return [f"it is a {kind}, not an nn.Linear (RowwiseParallel on {kind} is not a GEMM + all_reduce)"]
    weight, bias = module.weight, module.bias
    if is_dtensor(weight) and weight.device_mesh.ndim != 1:
        return [f"its weight lives on a {weight.device_mesh.ndim}-D device mesh {tuple(weight.placements)}; only a "
                "1-D tensor-parallel mesh is supported"]
    if not is_dtensor(weight) or tuple(weight.placements) != (Shard(1),):
        placements = tuple(weight.placements) if is_dtensor(weight) else "a plain tensor"
        return [f"its weight is {placements}, not sharded along the input dimension (Shard(1)): not row-parallel"
                + (" (ColwiseParallel shards the output dimension, Shard(0))" if placements == (Shard(0),) else "")]
    if layouts is None:
        return ["its weight is a Shard(1) DTensor but neither torch's RowwiseParallel hooks nor transformers' "
                "RowwiseParallel forward are on it (parallelized by another style or by hand), so its input and "
                "output handling is unknown"]
    problems = []
    if other_hooks:
        problems.append("it has other hooks that a replacement would drop: " + ", ".join(other_hooks))
    mesh = layouts.mesh
    if bias is not None and (not is_dtensor(bias) or tuple(bias.placements) != (Replicate(),)):
        problems.append("its bias is not a Replicate() DTensor")
    if reduce_scatter and sequence_shard_dim(layouts.output_layouts) is None:
        problems.append(f"its output_layouts is {layouts.output_layouts}, not Shard(d) on a sequence (row) dim: "
                        "no reduce-scatter to fuse")
    if not reduce_scatter and tuple(layouts.output_layouts) != (Replicate(),):
        problems.append(
            f"its output_layouts is {layouts.output_layouts}: a row-parallel GEMM followed by a reduce-scatter "
            "(sequence parallelism), not by an all_reduce; gemm_allreduce fuses only output_layouts=Replicate() "
            "(torch_gemm_ar.nn.replace_sequence_parallel converts the reduce-scatter form)"
        )
    world = mesh.size()
    if module.in_features % world:
        problems.append(f"in_features={module.in_features} is not divisible by the mesh size {world}: the shards "
                        "are uneven, and gemm_allreduce needs the same K on every rank")
    mesh_group = mesh.get_group()
    if group_name is not None and mesh_group.group_name != group_name:
        problems.append(f"it is sharded over the mesh's group {mesh_group.group_name!r} (size {world}), but "
                        f"group= names {group_name!r}: wrong group")
    return problems


def adopt_parallelized_linear(module: nn.Module, linear: nn.Linear, layouts: RowwiseLayouts, algorithm: str) -> None:
    """What a DTensor stand-in takes over from the parallelized nn.Linear: its sizes, the same Parameter objects and
    the style's mesh, layouts and group."""
    module.in_features = linear.in_features
    module.out_features = linear.out_features
    module.weight = linear.weight
    if linear.bias is None:
        module.register_parameter("bias", None)
    else:
        module.bias = linear.bias
    module.device_mesh = layouts.mesh
    module.input_layouts = layouts.input_layouts
    module.output_layouts = layouts.output_layouts
    module.use_local_output = layouts.use_local_output
    module.group_name = layouts.mesh.get_group().group_name
    module.algorithm = check_algorithm(algorithm, type(module).__name__)


def parallelized_linear_repr(module: nn.Module, *, with_output_layouts: bool) -> str:
    output = f"output_layouts={module.output_layouts}, " if with_output_layouts else ""
    return (f"in_features={module.in_features}, out_features={module.out_features}, bias={module.bias is not None}, "
            f"input_layouts={module.input_layouts}, {output}use_local_output={module.use_local_output}, "
            f"mesh_size={module.device_mesh.size()}, algorithm={module.algorithm!r}")


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group (Megatron's copy_to_tensor_model_parallel
    region). gemm_reduce_scatter's bias gradient is this rank's chunk's share (Megatron leaves the all-reduce of
    sequence-parallel parameters' gradients to the trainer); a Replicate DTensor bias gets the whole sum, as
    DTensor's own backward gives it."""

    @staticmethod
    def forward(ctx, t, group_name):
        ctx.group_name = group_name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        reduced = torch.ops._c10d_functional.all_reduce(grad.contiguous(), "sum", ctx.group_name)
        return torch.ops._c10d_functional.wait_tensor(reduced), None


class DTensorRowParallelLinear(nn.Module):
    """Stands in for an nn.Linear parallelized with RowwiseParallel: the same inputs, outputs and Parameter objects
    (weight: Shard(1) DTensor, bias: Replicate DTensor), so optimizers, gradient hooks and the state_dict (DTensor
    values under `weight` / `bias`) are unchanged. With output_layouts=Replicate() the local shard product and the
    all_reduce run as one gemm_allreduce on the mesh's group; with output_layouts=Shard(d) on a sequence dim
    (sequence parallelism) the product and the reduce-scatter run as one gemm_reduce_scatter.
    """

    def __init__(self, linear: nn.Linear, layouts: RowwiseLayouts, *, algorithm: str = "auto"):
        super().__init__()
        adopt_parallelized_linear(self, linear, layouts, algorithm)
        # None: all_reduce (Replicate output); else the output's sequence dim that the reduce-scatter splits.
        self.scatter_dim = None if layouts.output_layouts[0].is_replicate() else sequence_shard_dim(
            layouts.output_layouts)
        self.fuses_add_rmsnorm = self.scatter_dim is None  # forward(x, residual, norm) needs the whole rows

    def _local_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's [..., in/world] slice, reached the way RowwiseParallel's pre-hook reaches Shard(-1)."""
        from torch.distributed.tensor import DTensor, Shard

        last = x.dim() - 1
        if isinstance(x, DTensor):
            if not (len(x.placements) == 1 and x.placements[0].is_shard(last)):
                x = x.redistribute(self.device_mesh, (Shard(last),))
            return x.to_local()
        layout = self.input_layouts[0]
        if layout.is_shard() and layout.dim in (-1, last):
            return x  # the common case: the local shard itself, no DTensor round trip
        x = DTensor.from_local(x, self.device_mesh, self.input_layouts, run_check=False)
        return x.redistribute(self.device_mesh, (Shard(last),)).to_local()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, norm: Optional[nn.Module] = None):
        """`forward(x)`: as the parallelized nn.Linear. `forward(x, residual, norm)` with `norm` an nn.RMSNorm over
        out_features and `residual` a replicated tensor (local values): `(out, normed)` = (layer(x) + residual,
        norm(out)) through one gemm_allreduce_add_rmsnorm; plain tensors, or Replicate DTensors when the layer's
        output is a DTensor (use_local_output=False)."""
        if residual is not None or norm is not None:
            return self._forward_add_norm(x, residual, norm)
        local = self._local_shard(x)
        weight = self.weight.to_local()  # [out, in/world]; its gradient comes back as a Shard(1) DTensor
        bias = None if self.bias is None else self.bias.to_local()
        if local.shape[-1] != weight.shape[1]:
            raise ValueError(f"DTensorRowParallelLinear: the local input shard has {local.shape[-1]} features, the "
                             f"weight shard {weight.shape[1]}; input shape {tuple(local.shape)}")
        if self.scatter_dim is not None:
            return self._forward_reduce_scatter(local, weight, bias)
        lead = local.shape[:-1]
        if local.dim() not in (2, 3):  # the op takes 2-D or 3-D
            local = local.reshape(-1, local.shape[-1])
        out = gemm_allreduce(local, weight.t(), self.group_name, bias=bias, algorithm=self.algorithm)
        out = out.reshape(*lead, self.out_features)
        if self.use_local_output:
            return out
        from torch.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(out, self.device_mesh, (Replicate(),), run_check=False)

    def _forward_reduce_scatter(self, local, weight, bias):
        if bias is not None and bias.requires_grad:
            bias = _SumGradOverGroup.apply(bias, self.group_name)
        dim = self.scatter_dim + local.dim() if self.scatter_dim < 0 else self.scatter_dim
        if not 0 <= dim < local.dim() - 1 or local.dim() not in (2, 3):
            raise ValueError(f"DTensorRowParallelLinear: output_layouts {self.output_layouts} needs a 2-D or 3-D "
                             f"input whose dim {self.scatter_dim} is a sequence dim; input shape {tuple(local.shape)}")
        out = gemm_reduce_scatter(local, weight.t(), self.group_name, scatter_dim=dim, bias=bias,
                                  algorithm=self.algorithm)
        if self.use_local_output:
            return out
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(out, self.device_mesh, self.output_layouts, run_check=False)

    def _forward_add_norm(self, x, residual, norm):
        if not self.fuses_add_rmsnorm:
            raise ValueError(f"DTensorRowParallelLinear: forward(x, residual, norm) needs whole output rows, but this "
                             f"layer reduce-scatters its output ({self.output_layouts}); call forward(x) and add "
                             "and normalise the shard")
        check_norm("DTensorRowParallelLinear", norm, residual, self.out_features)
        local = self._local_shard(x)
        weight = self.weight.to_local()
        if local.shape[-1] != weight.shape[1]:
            raise ValueError(f"DTensorRowParallelLinear: the local input shard has {local.shape[-1]} features, the "
                             f"weight shard {weight.shape[1]}; input shape {tuple(local.shape)}")
        residual = residual.to_local() if hasattr(residual, "to_local") else residual  # replicated: local = whole
        bias = None if self.bias is None else self.bias.to_local()
        out, normed = add_rmsnorm_after_reduction(local, weight.t(), bias, residual, norm, self.group_name,
                                                  self.algorithm, self.out_features)
        if self.use_local_output:
            return out, normed
        from torch.distributed.tensor import DTensor, Replicate

        return tuple(DTensor.from_local(t, self.device_mesh, (Replicate(),), run_check=False) for t in (out, normed))

    def extra_repr(self) -> str:
        return parallelized_linear_repr(self, with_output_layouts=True)
