"""The FX rewrite: a local GEMM followed by a functional collective becomes one torch.ops.pto op.

Patterns, on aten-level graphs (AOT / Inductor post-grad), every `[reshape]` optional and only a reshape that keeps
the last dim (rows stay rows):
- gemm_allreduce:             mm(a, b) | addmm(bias / world, a, b) -> [reshape] [clone] -> all_reduce(sum) -> wait
- gemm_allreduce_add_rmsnorm: the above -> add(residual) -> RMSNorm written out (pow 2, mean over the last dim,
                              add eps, rsqrt, mul, mul weight; fp32 upcasts around it allowed)
- gemm_reduce_scatter:        mm(a, b) -> [reshape] -> reduce_scatter_tensor(sum) -> wait_tensor
- allgather_gemm:             all_gather_into_tensor(x) -> wait_tensor -> [reshape] -> mm(., b)
- the same two on 3-D activations, with row moves (view, permute, transpose, split, cat, clone, the write-back copy
  into a fresh buffer) around the collective, as DTensor's Shard(1) and spmd_types scatter and gather the sequence
  dim: rewritten with scatter_dim / gather_dim = d when the rows, evaluated as numbers (rows.py), land on every
  rank exactly where the op puts them along d. The gathered value G (several GEMMs may read it: q/k/v, w1/w3) is
  replaced by the gathered input allgather_gemm returns, so its first mm is fused and the others read that: one
  collective.
A site is rewritten only when every check holds: reduce op "sum", a group that resolves, with more than one rank,
and the collective's size matching it; a and b of one floating dtype the op supports (and b 2-D); every intermediate
value (the product, the reshape, the collective, the waited tensor of a fused add, the norm's steps) used by the next
step only, so nothing else in the graph sees a value that disappears. Anything else is left exactly as it was and the
reason is counted. addmm is taken only with the bias DTensor splits as bias / world per rank, which the fused op adds
once (a bias added whole on every rank would be counted `world` times: not rewritten).

A graph is walked twice: the first walk lists the sites that pass the checks, the group's ranks agree on them
(agreement.py: a site is rewritten only if every rank of its group compiles it too), and the second walk rewrites
the agreed sites.
"""
import logging
import math
import operator
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch import fx

from . import agreement, rows

logger = logging.getLogger("torch_gemm_ar.compile")

aten, prims = torch.ops.aten, torch.ops.prims
_FUNCOL = torch.ops._c10d_functional
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_DTYPES = {torch.float32, torch.float64, torch.bfloat16, torch.float16}
_DEVICES = {"cpu", "npu"}


@dataclass
class RewriteReport:
    """What one pass over one graph did: rewrites per pattern and sites left alone per reason."""

    rewritten: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)

    def merge(self, other: "RewriteReport") -> None:
        self.rewritten.update(other.rewritten)
        self.skipped.update(other.skipped)

    def __str__(self) -> str:
        done = ", ".join(f"{k} x{v}" for k, v in sorted(self.rewritten.items())) or "nothing"
        text = f"rewrote {done}"
        if self.skipped:
            text += "; left alone: " + "; ".join(f"{k} (x{v})" for k, v in sorted(self.skipped.items()))
        return text


class _Skip(Exception):
    """A site that does not match exactly; its message is the counted reason."""


class _NoProduct(_Skip):
    """A value holding the gathered rows that no mm reads: the search goes on to the next one."""


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _only_user(node: fx.Node, what: str) -> fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise _Skip(f"{what} has {len(users)} users (the fused op would hide it from the others)")
    return users[0]


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name).size()
    except Exception as exc:  # noqa: BLE001  (c10d raises a bare RuntimeError for unknown names)
        raise _Skip(f"group {group_name!r} does not resolve") from exc


def _check_group(group_name, size=None) -> int:
    if not isinstance(group_name, str):
        raise _Skip("the collective's group is not a group name")
    world = _group_size(group_name)
    if world < 2:
        raise _Skip("a group of one rank (nothing to fuse)")
    if size is not None and size != world:
        raise _Skip(f"the collective's size {size} is not its group's {world}")
    return world


def _check_operands(a: fx.Node, b: fx.Node, a_any_dim: bool = False) -> None:
    va, vb = _val(a), _val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        raise _Skip("no shape information on the GEMM's operands")
    if (va.dim() != 2 and not a_any_dim) or vb.dim() != 2:
        raise _Skip("the GEMM's operands are not 2-D")
    if va.dtype != vb.dtype or va.dtype not in _DTYPES:
        raise _Skip(f"dtypes {va.dtype}, {vb.dtype} (the op takes one of fp32, fp64, bf16, fp16)")
    if va.device != vb.device or va.device.type not in _DEVICES:
        raise _Skip(f"devices {va.device}, {vb.device}")


def _rows_reshape(node: fx.Node, producer: fx.Node) -> bool:
    """True if `node` reshapes `producer`'s [M, N] into [..., N] (rows stay rows)."""
    if not _is(node, *_RESHAPES) or node.args[0] is not producer:
        return False
    out, src = _val(node), _val(producer)
    return (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.dim() >= 1
            and out.shape[-1] == src.shape[-1] and out.numel() == src.numel())


def _static_last(node: fx.Node) -> int:
    last = _val(node).shape[-1]
    if not isinstance(last, int):
        raise _Skip("a symbolic last dimension")
    return last


def _shape_arg(node: fx.Node):
    """A reshape argument that gives `node`'s shape in the graph: a reshape node's own argument (its symbolic sizes
    are graph values), or the sizes with at most one symbolic size written as -1."""
    if _is(node, *_RESHAPES) and isinstance(node.args[1], (list, tuple)):
        return list(node.args[1])
    dims = list(_val(node).shape)
    symbolic = [i for i, d in enumerate(dims) if not isinstance(d, int)]
    if len(symbolic) > 1:
        raise _Skip("more than one symbolic size in the result's shape")
    return [-1 if i in symbolic else d for i, d in enumerate(dims)]


def _gemm(node: fx.Node):
    """(a, b, bias_node_or_None, world_divisor) of mm / addmm(bias / d, a, b); raises _Skip otherwise."""
    if _is(node, aten.mm.default):
        return node.args[0], node.args[1], None, None
    if _is(node, aten.addmm.default):
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise _Skip("addmm with beta or alpha")
        c, a, b = node.args[:3]
        if _is(c, aten.div.Tensor) and isinstance(c.args[1], (int, float)) and len(c.users) == 1:
            bias, divisor = c.args[0], c.args[1]
            vb = _val(bias)
            if isinstance(vb, torch.Tensor) and vb.dim() == 1:
                return a, b, bias, divisor
        raise _Skip("addmm whose bias is not split as bias / world (its sum would count the bias world times)")
    raise _Skip("not mm/addmm")


_FRAME = re.compile(r'File "([^"]*)", line (\d+), in \S+')


def _source(node: fx.Node) -> str:
    """Where `node` comes from, alike on every rank that traced it: its stack trace (file names without their
    directories and without function names, which differ in dynamo's resume functions), module path, and whether
    it is in a forward or a backward graph."""
    trace = _FRAME.sub(lambda m: f"{os.path.basename(m[1])}:{m[2]}", node.meta.get("stack_trace") or "")
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    path = "/".join(str(entry[0]) for entry in stack.values())
    return f"{trace}|{path}|{node.meta.get('partitioner_tag', '')}"


def _operand(node) -> str:
    value = _val(node)
    if not isinstance(value, torch.Tensor):
        return "-"
    return f"{value.dtype}{[d if isinstance(d, int) else '?' for d in value.shape]}"


class _Rewriter:
    def __init__(self, graph: fx.Graph, decided: Optional[Dict[fx.Node, Optional[str]]] = None):
        """decided=None: only list the candidate sites (self.candidates); else rewrite the sites whose collective
        maps to None there, and count the others with their reason."""
        self.graph = graph
        self.report = RewriteReport()
        self.decided = decided
        self.candidates = []  # (collective node, group name, description), in graph order
        from torch._guards import detect_fake_mode

        self.fake_mode = detect_fake_mode([_val(n) for n in graph.nodes if isinstance(_val(n), torch.Tensor)])

    # --- building new nodes with their fake values (Inductor reads node.meta["val"]) --------------------------------
    def _meta(self, node: fx.Node, fn, *args, **kwargs):
        if self.fake_mode is not None:
            args, kwargs = fx.node.map_arg((args, kwargs), lambda n: _val(n))
            with self.fake_mode:
                node.meta["val"] = fn(*args, **kwargs)
        return node

    def _call(self, target, args, kwargs=None):
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        return self._meta(node, target, *args, **(kwargs or {}))

    def _reshape(self, x: fx.Node, like: fx.Node, shape_arg) -> fx.Node:
        """`x` reshaped to the shape of `like` (`shape_arg`, from _shape_arg, computed before the graph changed)."""
        if [str(d) for d in _val(x).shape] == [str(d) for d in _val(like).shape]:
            return x
        return self._call(aten.reshape.default, (x, shape_arg))

    def _rows(self, x: fx.Node) -> fx.Node:
        """`x` as [rows, last dim] (a no-op for 2-D)."""
        if _val(x).dim() == 2:
            return x
        return self._call(aten.reshape.default, (x, [-1, _static_last(x)]))

    def _getitem(self, node: fx.Node, index: int) -> fx.Node:
        item = self.graph.call_function(operator.getitem, (node, index))
        item.meta["val"] = _val(node)[index] if _val(node) is not None else None
        return item

    def _claim(self, collective: fx.Node, pattern: str, group_name: str, gemm: fx.Node, *operands) -> bool:
        """Called when a site passed every check: in the listing walk, list it and go no further (False); in the
        rewriting walk, True if its group's ranks agreed on it, else raise _Skip with the reason."""
        if self.decided is None:
            description = "\n".join([pattern, group_name, *map(_operand, operands), _source(gemm), _source(collective)])
            self.candidates.append((collective, group_name, description))
            return False
        reason = self.decided.get(collective, "not rewritten: the site was not listed (the graph changed meanwhile)")
        if reason is not None:
            raise _Skip(reason)
        return True

    # --- the patterns ------------------------------------------------------------------------------------------------
    def run(self) -> RewriteReport:
        for node in list(self.graph.nodes):
            if getattr(node, "_erased", False):
                continue
            try:
                if _is(node, _FUNCOL.all_reduce.default):
                    self._all_reduce(node)
                elif _is(node, _FUNCOL.reduce_scatter_tensor.default):
                    self._reduce_scatter(node)
                elif _is(node, _FUNCOL.all_gather_into_tensor.default):
                    self._all_gather(node)
            except _Skip as why:
                self.report.skipped[f"{node.target.__name__ if hasattr(node.target, '__name__') else node.target}: "
                                    f"{why}"] += 1
        return self.report

    def _erase(self, *nodes) -> None:
        """Erase the replaced nodes, users first (explicitly: dead-code elimination keeps collectives, as impure)."""
        for node in nodes:
            if isinstance(node, fx.Node) and not getattr(node, "_erased", False) and not node.users:
                self.graph.erase_node(node)

    def _before(self, first: fx.Node, second: fx.Node) -> bool:
        for node in self.graph.nodes:
            if node is first:
                return True
            if node is second:
                return False
        return False

    def _producer(self, collective: fx.Node, what: str, write_back: Optional[fx.Node] = None):
        """The GEMM feeding `collective` through reshapes that keep rows as rows and clones (which copy values
        unchanged): (gemm, those steps, the collective's side first). The collective's input may have one more
        user: `write_back`, the functional form of an in-place collective."""
        x = collective.args[0]
        steps, node = [], x
        while _is(node, *_RESHAPES, aten.clone.default) and isinstance(node.args[0], fx.Node):
            if _is(node, aten.clone.default) and node.kwargs.get("memory_format", torch.contiguous_format) not in (
                    torch.contiguous_format, torch.preserve_format):
                break
            if _is(node, *_RESHAPES) and not _rows_reshape(node, node.args[0]):
                raise _Skip(f"its input is not a GEMM ({what})")
            steps.append(node)
            node = node.args[0]
        gemm = node
        if not _is(gemm, aten.mm.default, aten.addmm.default):
            raise _Skip(f"its input is not a GEMM ({what})")
        others = [u for u in x.users if u is not collective and u is not write_back]
        if others:
            raise _Skip(f"the GEMM output has {len(others)} other user(s) (the fused op would hide it from them)")
        for step in steps[1:] + ([gemm] if steps else []):
            _only_user(step, "the GEMM output")
        return gemm, steps

    def _wait_of(self, collective: fx.Node) -> fx.Node:
        wait = _only_user(collective, "the collective")
        if not _is(wait, _FUNCOL.wait_tensor.default):
            raise _Skip("the collective's result is not waited on directly")
        return wait

    @staticmethod
    def _result_of(wait: fx.Node, collective: fx.Node):
        """(result, passed): the value the graph goes on with after `wait`, and the no-op nodes on the way there:
        the write-back `copy(input, wait)` that functionalization makes of an in-place collective
        (dist.all_reduce(t)), and reshapes that keep the last dim."""
        result, passed = wait, []
        users = list(wait.users)
        if (len(users) == 1 and _is(users[0], aten.copy.default) and users[0].args[0] is collective.args[0]
                and users[0].args[1] is wait and not users[0].kwargs
                and tuple(_val(users[0]).shape) == tuple(_val(wait).shape)
                and _val(users[0]).dtype == _val(wait).dtype):
            passed.append(wait)
            result = users[0]
        while len(result.users) == 1:
            user = next(iter(result.users))
            if not (_is(user, *_RESHAPES) and isinstance(_val(user), torch.Tensor)
                    and _val(user).shape[-1] == _val(result).shape[-1]):
                break
            passed.append(result)
            result = user
        return result, passed

    def _all_reduce(self, ar: fx.Node) -> None:
        _, op, group_name = ar.args[:3]
        if str(op).lower() != "sum":
            raise _Skip(f"reduce op {op!r}, not sum")
        world = _check_group(group_name)
        wait = self._wait_of(ar)
        result, passed = self._result_of(wait, ar)
        write_back = passed[1] if len(passed) > 1 and _is(passed[1], aten.copy.default) else (
            result if _is(result, aten.copy.default) else None)
        gemm, steps = self._producer(ar, "mm/addmm", write_back)
        a, b, bias, divisor = _gemm(gemm)
        if bias is not None and divisor != world:
            raise _Skip(f"addmm bias divided by {divisor}, not by the group's size {world}")
        _check_operands(a, b)
        if bias is not None and (_val(bias).dtype != _val(a).dtype or tuple(_val(bias).shape) != (_val(b).shape[1],)):
            raise _Skip("a bias of another dtype or shape than the product's row")
        shape = _shape_arg(result)
        replaced = (result, *reversed(passed), ar, *steps, gemm, None if bias is None else gemm.args[0])
        wait = result  # from here on, the value the rest of the graph reads
        norm = self._add_rmsnorm(wait)
        if norm is not None and not self._before(norm["weight"], norm["add"]):
            norm = None  # the norm weight is computed after the add: the fused op could not be placed there
        if norm is None:
            if not self._claim(ar, "gemm_allreduce", group_name, gemm, a, b, bias):
                return
            with self.graph.inserting_before(wait):
                out = self._call(torch.ops.pto.gemm_allreduce.default, (a, b, group_name), {"bias": bias})
                wait.replace_all_uses_with(self._reshape(out, wait, shape))
            self._erase(*replaced)
            self.report.rewritten["gemm_allreduce"] += 1
            return
        add, last = norm["add"], norm["last"]
        _static_last(add)
        if not self._claim(ar, "gemm_allreduce_add_rmsnorm", group_name, gemm, a, b, bias, norm["residual"],
                           norm["weight"]):
            return
        with self.graph.inserting_before(add):  # every input of the fused op is defined before the add
            residual = self._rows(norm["residual"])
            fused = self._call(torch.ops.pto.gemm_allreduce_add_rmsnorm.default,
                               (a, b, residual, norm["weight"], group_name), {"eps": norm["eps"], "bias": bias})
            out = self._reshape(self._getitem(fused, 0), add, shape)
            normed = self._reshape(self._getitem(fused, 1), last, shape)
        last.replace_all_uses_with(normed)
        self._erase(*norm["chain"])
        add.replace_all_uses_with(out)
        self._erase(add, *replaced)
        self.report.rewritten["gemm_allreduce_add_rmsnorm"] += 1

    def _add_rmsnorm(self, wait: fx.Node) -> Optional[Dict]:
        """The residual add and RMSNorm after `wait`, if they are there exactly; else None (plain gemm_allreduce)."""
        if len(wait.users) != 1:
            return None
        add = next(iter(wait.users))
        if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
            return None
        residual = add.args[1] if add.args[0] is wait else add.args[0]
        vo, vr = _val(wait), _val(residual)
        if (not isinstance(residual, fx.Node) or not isinstance(vr, torch.Tensor) or residual is wait
                or tuple(vr.shape) != tuple(vo.shape) or vr.dtype != vo.dtype or vr.device != vo.device):
            return None
        dtype = vo.dtype
        # The norm reads `add` (or its fp32 upcast) twice: squared for the statistics, and scaled.
        sources = [add] + [u for u in add.users if _is(u, prims.convert_element_type.default, aten._to_copy.default)]
        pow_ = next((u for s in sources for u in s.users if _is(u, aten.pow.Tensor_Scalar) and u.args[1] == 2), None)
        if pow_ is None:
            return None
        src = pow_.args[0]
        if src is not add and (len(src.users) != 2 or not self._upcast(src, add)):
            return None
        try:
            mean = _only_user(pow_, "pow")
            if not _is(mean, aten.mean.dim) or not self._last_dim(mean, vo.dim()):
                return None
            eps_add = _only_user(mean, "mean")
            if (not _is(eps_add, aten.add.Tensor, aten.add.Scalar) or eps_add.kwargs
                    or not isinstance(eps_add.args[1], (int, float))):
                return None
            rsqrt = _only_user(eps_add, "eps add")
            if not _is(rsqrt, aten.rsqrt.default):
                return None
            scaled = _only_user(rsqrt, "rsqrt")
            if not _is(scaled, aten.mul.Tensor) or set(scaled.args) != {src, rsqrt}:
                return None
            if src is not add and set(src.users) != {pow_, scaled}:
                return None
            chain = [scaled, rsqrt, eps_add, mean, pow_] + ([] if src is add else [src])
            nxt = _only_user(scaled, "the normalised value")
            if self._cast(nxt, dtype):  # back to the model's dtype, then the weight (transformers' LlamaRMSNorm)
                chain.insert(0, nxt)
                scaled, nxt = nxt, _only_user(nxt, "the downcast")
            if not _is(nxt, aten.mul.Tensor) or scaled not in nxt.args:
                return None
            weight = nxt.args[1] if nxt.args[0] is scaled else nxt.args[0]
            if _val(nxt).dtype != dtype:  # the weight applied in fp32, then back to the model's dtype (nn.RMSNorm)
                after = _only_user(nxt, "the weighted value")
                if not self._cast(after, dtype):
                    return None
                chain.insert(0, nxt)
                nxt = after
            vw = _val(weight)
            if (not isinstance(weight, fx.Node) or not isinstance(vw, torch.Tensor)
                    or tuple(vw.shape) != (vo.shape[-1],)
                    or vw.dtype != dtype or _val(nxt).dtype != dtype or tuple(_val(nxt).shape) != tuple(vo.shape)):
                return None
        except _Skip:
            return None
        return {"add": add, "residual": residual, "weight": weight, "eps": float(eps_add.args[1]), "last": nxt,
                "chain": [nxt] + chain}

    @staticmethod
    def _cast(node: fx.Node, dtype) -> bool:
        """`node` converts to `dtype` and does nothing else."""
        if _is(node, prims.convert_element_type.default):
            return node.args[1] == dtype
        return (_is(node, aten._to_copy.default) and node.kwargs.get("dtype") == dtype and len(node.args) == 1
                and set(node.kwargs) <= {"dtype", "layout", "device"} and _val(node) is not None
                and _val(node).device == _val(node.args[0]).device)

    @staticmethod
    def _upcast(node: fx.Node, of: fx.Node) -> bool:
        return node.args[0] is of and _Rewriter._cast(node, torch.float32)

    @staticmethod
    def _last_dim(mean: fx.Node, ndim: int) -> bool:
        dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
        keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        return bool(keep) and list(dims or []) in ([-1], [ndim - 1]) and "dtype" not in mean.kwargs

    def _reduce_scatter(self, rs: fx.Node) -> None:
        _, op, size, group_name = rs.args[:4]
        if str(op).lower() != "sum":
            raise _Skip(f"reduce op {op!r}, not sum")
        _check_group(group_name, size)
        wait = self._wait_of(rs)
        try:
            gemm, steps = self._producer(rs, "mm")
        except _Skip as plain:
            return self._reduce_scatter_moved(rs, wait, size, group_name, plain)
        if not _is(gemm, aten.mm.default):
            raise _Skip("a reduce-scatter after addmm")
        a, b = gemm.args[:2]
        _check_operands(a, b)
        if _val(gemm).shape[0] % size:
            raise _Skip("rows not divisible by the group size")
        shape = _shape_arg(wait)
        if not self._claim(rs, "gemm_reduce_scatter", group_name, gemm, a, b):
            return
        with self.graph.inserting_before(wait):
            out = self._call(torch.ops.pto.gemm_reduce_scatter.default, (a, b, group_name), {"scatter_dim": 0})
            wait.replace_all_uses_with(self._reshape(out, wait, shape))
        self._erase(wait, rs, *steps, gemm)
        self.report.rewritten["gemm_reduce_scatter"] += 1

    def _reduce_scatter_moved(self, rs: fx.Node, wait: fx.Node, size: int, group_name: str, plain: _Skip) -> None:
        """mm -> row moves (view, permute, split, cat, clone) -> reduce_scatter_tensor -> wait -> row moves, as
        DTensor and spmd_types scatter a sequence dim: rewritten when, on row numbers, what rank r ends up with is
        chunk r of the product along one row dim, which is gemm_reduce_scatter(scatter_dim=that dim)."""
        position = {node: i for i, node in enumerate(self.graph.nodes)}
        gemm, moves = self._moves_from_gemm(rs, position, plain)
        after = self._moves_after(wait)
        if not _is(gemm, aten.mm.default):
            raise _Skip(f"{plain}: the row moves start at addmm, not mm")
        buffers = [step.args[0] for step in after if _is(step, aten.copy.default)]
        for node in (gemm, *moves):
            others = [u for u in node.users if u not in moves and u is not rs and u not in buffers]
            if others:
                raise _Skip(f"{node.name} on the way to the reduce-scatter has {len(others)} other user(s) (the "
                            "fused op would hide it from them)")
        a, b = gemm.args[:2]
        _check_operands(a, b)
        try:
            rows_of = {gemm: rows.numbers(rows.static_shape(gemm)[:1])}
            for node in moves:
                rows_of[node] = rows.evaluate(node, rows_of)
            sent = rows_of[rs.args[0]]
            if sent.dim() == 0 or sent.shape[0] % size:
                raise _Skip("the reduce-scatter's dim 0 is not divisible by the group size")
            received = []  # per rank: the row numbers of every step after the wait
            for chunk in sent.chunk(size, 0):
                on_rank = {wait: chunk}
                for node in after:
                    on_rank[node] = rows.evaluate(node, on_rank)
                received.append(on_rank)
        except rows.NotRows as why:
            raise _Skip(f"{plain}; nor rows of one moved ({why})") from None
        count = rows.static_shape(gemm)[0]
        for end in reversed([wait, *after]):  # the furthest step that still holds the scattered product
            lead = list(received[0][end].shape)
            for dim in range(len(lead)):
                full = lead[:dim] + [lead[dim] * size] + lead[dim + 1:]
                if math.prod(full) != count:
                    continue
                product = rows.numbers(full).chunk(size, dim)
                if all(rows.equal(product[r], received[r][end]) for r in range(size)):
                    return self._fuse_reduce_scatter(rs, wait, gemm, moves, after[:after.index(end) + 1]
                                                     if end is not wait else [], buffers, full, dim, group_name)
        raise _Skip("the rows reach the ranks in another order than a reduce-scatter of the product along one of "
                    "its dims (a split along another dim, a cat in another order)")

    def _fuse_reduce_scatter(self, rs, wait, gemm, moves, after, buffers, full, dim, group_name) -> None:
        a, b = gemm.args[:2]
        if not self._claim(rs, f"gemm_reduce_scatter(scatter_dim={dim})", group_name, gemm, a, b):
            return
        end = after[-1] if after else wait
        with self.graph.inserting_before(rs):
            a_rows = self._call(aten.reshape.default, (a, [*full, _static_last(a)]))
            out = self._call(torch.ops.pto.gemm_reduce_scatter.default, (a_rows, b, group_name), {"scatter_dim": dim})
        end.replace_all_uses_with(out)
        self._erase(*reversed(after), wait, rs, *buffers, *reversed(moves), gemm)
        self.report.rewritten["gemm_reduce_scatter"] += 1

    def _moves_from_gemm(self, collective: fx.Node, position, plain: _Skip):
        """The one mm whose product reaches `collective`'s input through row moves only, and those moves in graph
        order."""
        moves, gemms, stack = set(), set(), [collective.args[0]]
        while stack:
            node = stack.pop()
            if node in moves or node in gemms:
                continue
            if _is(node, aten.mm.default, aten.addmm.default):
                gemms.add(node)
            elif rows.is_move(node):
                moves.add(node)
                stack.extend(rows.inputs(node))
            else:
                raise _Skip(str(plain))
        if len(gemms) != 1:
            raise _Skip(f"{plain}: the row moves join {len(gemms)} GEMMs")
        return gemms.pop(), sorted(moves, key=position.get)

    @staticmethod
    def _moves_after(wait: fx.Node):
        """The row moves that follow `wait`, each the only user of the one before."""
        chain, node = [], wait
        while len(node.users) == 1:
            user = next(iter(node.users))
            if not rows.is_move(user) or _is(user, *rows.SPLITS) or rows.inputs(user) != [node]:
                break
            chain.append(user)
            node = user
        return chain

    def _all_gather(self, ag: fx.Node) -> None:
        x, size, group_name = ag.args[:3]
        _check_group(group_name, size)
        wait = self._wait_of(ag)
        try:
            mm, gathered = self._gathered_mm(wait)
        except _Skip as plain:
            return self._all_gather_moved(ag, wait, size, group_name, plain)
        b = mm.args[1]
        _check_operands(x, b, a_any_dim=True)
        _static_last(x)
        if not self._claim(ag, "allgather_gemm", group_name, mm, x, b):
            return
        with self.graph.inserting_before(mm):
            x_rows = self._rows(x)
            fused = self._call(torch.ops.pto.allgather_gemm.default, (x_rows, b, group_name), {"gather_dim": 0})
            mm.replace_all_uses_with(self._getitem(fused, 0))
        self._erase(mm, gathered, wait, ag)
        self.report.rewritten["allgather_gemm"] += 1

    @staticmethod
    def _gathered_mm(wait: fx.Node):
        """all_gather -> wait -> [rows reshape] -> mm as the only use: (mm, its left operand)."""
        user = _only_user(wait, "the gathered tensor")
        if _is(user, *_RESHAPES):
            if _val(user).dim() != 2 or _val(user).shape[-1] != _val(wait).shape[-1]:
                raise _Skip("the gathered tensor is reshaped other than to rows")
            mm = _only_user(user, "the reshaped gathered tensor")
            gathered = user
        else:
            mm, gathered = user, wait
        if not _is(mm, aten.mm.default) or mm.args[0] is not gathered:
            raise _Skip("the gathered tensor does not feed an mm as its left operand")
        return mm, gathered

    def _all_gather_moved(self, ag: fx.Node, wait: fx.Node, size: int, group_name: str, plain: _Skip) -> None:
        """[row moves ->] all_gather -> wait -> row moves (split, cat, view, copy into a buffer) -> G -> mm(G or G's
        rows, b) and any other users of G, as DTensor and spmd_types gather a sequence dim and the layers after it
        (q/k/v, w1/w3) read it: rewritten when, on row numbers, G is the concatenation of the ranks' inputs along
        one row dim, which is allgather_gemm(gather_dim=that dim). The first mm becomes allgather_gemm; G becomes
        the gathered input that it returns, so the other users (more GEMMs, values saved for backward) read that:
        one collective. The input may be a moved source (spmd_types moves the sequence dim to the front first)."""
        position = {node: i for i, node in enumerate(self.graph.nodes)}
        reasons = []
        for source, before in self._sources(ag.args[0]):
            try:
                shape = rows.static_shape(source)
                lead = shape[:-1]
                if not lead:
                    raise rows.NotRows("a 1-D input")
                local = rows.numbers([size, *lead])  # rank r's source rows are numbered local[r]
                gathered = [torch.cat(list(local), dim) for dim in range(len(lead))]  # per gather dim
                sent = []
                for r in range(size):
                    on_rank = {source: local[r]}
                    for node in before:
                        on_rank[node] = rows.evaluate(node, on_rank)
                    sent.append(on_rank[ag.args[0]])
                rows_of = {wait: torch.cat(sent, 0)}
            except rows.NotRows as why:
                reasons.append(f"{plain}; nor rows gathered ({why})")
                continue
            for node in sorted(self._reachable(wait), key=position.get):
                if all(i in rows_of for i in rows.inputs(node)):
                    try:
                        rows_of[node] = rows.evaluate(node, rows_of)
                    except rows.NotRows:
                        continue
            for node in sorted(rows_of, key=position.get):
                dim = next((d for d, g in enumerate(gathered) if rows.equal(rows_of[node], g)), None)
                if dim is None or _val(node).shape[-1] != shape[-1]:
                    continue
                try:
                    return self._fuse_all_gather(ag, wait, source, before, node, dim, position, group_name)
                except _NoProduct:
                    continue
                except _Skip as why:
                    reasons.append(str(why))
        raise _Skip(reasons[-1] if reasons else f"{plain}; nor are the gathered rows, moved, the left operand of an mm "
                    "in the order of a gather along one dim (a split along another dim, a cat in another order)")

    @staticmethod
    def _sources(x: fx.Node):
        """(source, the row moves from it to `x`): `x` itself, then each value it was moved from by a chain of views,
        transposes, permutes and clones that nothing else reads."""
        found, before, node = [(x, [])], [], x
        while (rows.is_move(node) and not _is(node, aten.copy.default, aten.cat.default, operator.getitem)
               and isinstance(node.args[0], fx.Node) and (node is x or len(node.users) == 1)):
            before = [node] + before
            node = node.args[0]
            found.append((node, list(before)))
        return found

    @staticmethod
    def _reachable(start: fx.Node):
        """Nodes reached from `start` through row moves."""
        seen, stack = set(), [start]
        while stack:
            for user in stack.pop().users:
                if user not in seen and rows.is_move(user):
                    seen.add(user)
                    stack.append(user)
        return seen

    def _fuse_all_gather(self, ag, wait, x, before, full, dim, position, group_name) -> None:
        """`full` (the gathered rows of `x` along `dim`) feeds an mm, directly or as [rows, K]: fuse the first one.
        `before`: the row moves from `x` to the all-gather's input, erased with the gather."""
        products = []
        for user in full.users:
            if _is(user, aten.mm.default) and user.args[0] is full:
                products.append((user, None))
            elif _is(user, *_RESHAPES) and _rows_reshape(user, full) and _val(user).dim() == 2:
                products += [(mm, user) for mm in user.users if _is(mm, aten.mm.default) and mm.args[0] is user]
        if not products:
            raise _NoProduct("the gathered rows do not feed an mm as its left operand")
        mm, view = min(products, key=lambda p: position[p[0]])
        b = mm.args[1]
        first_use = min(full.users, key=position.get)
        move = self._hoistable(b, position[first_use], position)
        if move is None:
            raise _Skip("the GEMM's right operand is computed after the gathered rows are first used")
        _check_operands(x, b, a_any_dim=True)
        _static_last(x)
        between = self._between(wait, full)
        inside = set(between) | {full}
        for node in [wait, *between]:
            if any(u not in inside and u not in between for u in node.users):
                raise _Skip(f"{node.name}, a step of the gather, has users outside it (the fused op would hide it)")
        buffers = [step.args[0] for step in between if _is(step, aten.copy.default)]
        if not self._claim(ag, f"allgather_gemm(gather_dim={dim})", group_name, mm, x, b):
            return
        for node in move:  # views of a weight (backward's transposed weight): computed earlier, where the op goes
            first_use.prepend(node)
        with self.graph.inserting_before(first_use):
            fused = self._call(torch.ops.pto.allgather_gemm.default, (x, b, group_name),
                               {"gather_dim": dim, "return_gathered": True})
            out = self._getitem(fused, 0)
            gathered = self._getitem(fused, 1)
            product = self._call(aten.reshape.default, (out, _shape_arg(mm)))
        mm.replace_all_uses_with(product)
        self._erase(mm, view)
        full.replace_all_uses_with(gathered)
        self._erase(full, *sorted(between, key=position.get, reverse=True), *buffers, wait, ag, *reversed(before))
        self.report.rewritten["allgather_gemm"] += 1

    @staticmethod
    def _hoistable(node: fx.Node, limit: int, position):
        """The nodes to move in front of position `limit` so that `node` is computed there, in graph order: none if
        it already is; views (t, permute, transpose, reshape) of values computed before it; else None."""
        if position.get(node, -1) < limit:
            return []
        if not _is(node, aten.t.default, aten.permute.default, aten.transpose.int, *_RESHAPES):
            return None
        moved = []
        for source in node.all_input_nodes:
            more = _Rewriter._hoistable(source, limit, position)
            if more is None:
                return None
            moved += [n for n in more if n not in moved]
        return moved + [node]

    @staticmethod
    def _between(wait: fx.Node, full: fx.Node):
        """The row moves from `wait` (excluded) to `full` (excluded), users after what they read."""
        seen, order, stack = set(), [], [full]
        while stack:
            node = stack.pop()
            for source in rows.inputs(node) if node is not wait else []:
                if source is not wait and source not in seen:
                    seen.add(source)
                    order.append(source)
                    stack.append(source)
        return order


def rewrite_graph(graph: fx.Graph) -> RewriteReport:
    """Rewrite `graph` in place; returns what was rewritten and what was left alone (and why). Sites are rewritten
    only where every rank of their group agreed (agreement.py); this waits for the group's other ranks."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # The rewrite computes on real row numbers (rows.py); a compiler may call it with a fake mode active.
    with unset_fake_temporarily():
        listing = _Rewriter(graph)
        listing.run()
        sites = listing.candidates
        reasons = agreement.agree([(group_name, description) for _, group_name, description in sites])
        report = _Rewriter(graph, {node: reason for (node, _, _), reason in zip(sites, reasons)}).run()
    if report.rewritten or report.skipped:
        logger.info("torch_gemm_ar.compile: %s", report)
    return report


__all__ = ["RewriteReport", "rewrite_graph"]
