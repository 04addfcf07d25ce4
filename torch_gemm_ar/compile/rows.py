"""Where the rows go: data-movement steps around a collective (view, permute, transpose, split, cat, clone, the
write-back copy of an in-place collective) evaluated on row numbers, so the rewrite can prove that a chain of them
puts a GEMM's rows exactly where a pto op's scatter_dim / gather_dim does.

Every value is tracked by the row numbers of its elements: a tensor of shape `value.shape[:-1]` whose entries say
which row of the source (the GEMM's product, or the gathered input) each row came from. A step that moves, splits
or merges the last dim is not a row move and is refused, so the columns stay whole and in order. Evaluating on row
numbers is exact for static shapes: two chains that agree on the row numbers move every element alike, whatever the
values. Symbolic sizes are refused (one evaluation cannot prove a graph that runs at other sizes).
"""
import operator
from typing import Dict, List, Optional

import torch
from torch import fx

aten = torch.ops.aten

_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
_EMPTIES = (aten.empty.memory_format, aten.new_empty.default, aten.empty_like.default)
MOVES = (*_RESHAPES, aten.permute.default, aten.transpose.int, aten.clone.default, *SPLITS, operator.getitem,
         aten.cat.default, aten.copy.default)


class NotRows(Exception):
    """The step is not a pure move of whole rows (its message says why)."""


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def static_shape(node: fx.Node) -> List[int]:
    value = _val(node)
    if not isinstance(value, torch.Tensor):
        raise NotRows(f"no shape information on {node.name}")
    shape = list(value.shape)
    if not all(isinstance(d, int) for d in shape):
        raise NotRows(f"symbolic sizes on {node.name} (a row map is proven for static shapes only)")
    return shape


def _dim(dim: int, ndim: int, node: fx.Node) -> int:
    dim = dim + ndim if dim < 0 else dim
    if not 0 <= dim < ndim - 1:
        raise NotRows(f"{node.name} moves the last dim")
    return dim


def is_empty_buffer(node, reader: fx.Node) -> bool:
    """`node` is a fresh buffer (empty / new_empty) whose only user is `reader`, the copy that fills it whole."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _EMPTIES
            and list(node.users) == [reader])


def inputs(node: fx.Node) -> List[fx.Node]:
    """The tensors a move reads rows from (a write-back copy reads its source; its buffer is only overwritten)."""
    if node.target is aten.cat.default:
        return list(node.args[0])
    if node.target is aten.copy.default:
        return [node.args[1]]
    return [node.args[0]]


def is_move(node: fx.Node) -> bool:
    """`node` is one of the data-movement steps this module evaluates (its arguments are checked at evaluation)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in MOVES):
        return False
    if node.target is aten.copy.default:  # only the write-back into a fresh buffer, which is its source's values
        return not node.kwargs and is_empty_buffer(node.args[0], node)
    if node.target is aten.clone.default:
        return node.kwargs.get("memory_format", torch.contiguous_format) in (torch.contiguous_format,
                                                                          torch.preserve_format)
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and source.op == "call_function" and source.target in SPLITS
    return True


def evaluate(node: fx.Node, env: Dict[fx.Node, object]):
    """The row numbers of `node`'s result from those of its inputs in `env` (a list for a split)."""
    try:
        return _evaluate(node, env)
    except (RuntimeError, IndexError, TypeError, ValueError) as error:  # arguments this module does not read
        raise NotRows(f"{node.name}: {type(error).__name__}") from None


def _evaluate(node: fx.Node, env: Dict[fx.Node, object]):
    target, args = node.target, node.args
    if target is operator.getitem:
        return env[args[0]][args[1]]
    if target in SPLITS:
        ndim = len(static_shape(args[0]))
        dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
        return list(torch.split(env[args[0]], args[1], _dim(dim, ndim, node)))
    shape = static_shape(node)
    if target is aten.cat.default:
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
        parts = [env[part] for part in args[0]]
        if any(static_shape(part)[-1] != shape[-1] for part in args[0]):
            raise NotRows(f"{node.name} joins along the last dim")
        return torch.cat(parts, _dim(dim, len(shape), node))
    source = inputs(node)[0]
    rows = env[source]
    if static_shape(source)[-1] != shape[-1]:
        raise NotRows(f"{node.name} changes the last dim")
    if target in _RESHAPES:
        return rows.reshape(shape[:-1])
    if target is aten.permute.default:
        dims = [d % len(shape) for d in args[1]]
        if dims[-1] != len(shape) - 1:
            raise NotRows(f"{node.name} moves the last dim")
        return rows.permute(dims[:-1])
    if target is aten.transpose.int:
        return rows.transpose(_dim(args[1], len(shape), node), _dim(args[2], len(shape), node))
    if target is aten.copy.default and (static_shape(source) != shape
                                        or _val(source).dtype != _val(node).dtype):
        # A broadcasting or casting copy is not its source's rows: replacing it would change a shape or dtype.
        raise NotRows(f"{node.name} broadcasts or casts its source")
    if target in (aten.clone.default, aten.copy.default):
        return rows
    raise NotRows(f"{node.name} is not a row move")


def equal(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and bool(torch.equal(a, b)))


def numbers(shape: List[int]) -> torch.Tensor:
    """Rows numbered in order: the row map of a tensor that nothing has moved yet."""
    count = 1
    for d in shape:
        count *= d
    return torch.arange(count).reshape(shape)


__all__ = ["MOVES", "NotRows", "SPLITS", "equal", "evaluate", "inputs", "is_empty_buffer", "is_move", "numbers",
           "static_shape"]
