"""A Llama-style decoder block (attention + SwiGLU MLP) with tensor parallelism over CPU ranks: unfused TP vs the same
model converted by torch_gemm_ar.nn.replace_row_parallel (with replace_column_parallel, or replace_sequence_parallel).

    torchrun --nproc-per-node 2 examples/tp_transformer.py                 # all three TP styles
    torchrun --nproc-per-node 2 examples/tp_transformer.py --style plain --algorithm chunked
    torchrun --nproc-per-node 2 examples/tp_transformer.py --style sp      # sequence parallelism

Three ways of writing the unfused TP model, each converted in place:
- dtensor: torch.distributed.tensor.parallel.parallelize_module with ColwiseParallel for q/k/v/gate/up and
  RowwiseParallel for o_proj/down_proj; converted by replace_row_parallel(model) and replace_column_parallel(model)
  (the column-parallel layers' backward all-reduce of the input gradient becomes a gemm_allreduce).
- plain: Megatron-style layers written by hand (UnfusedColumnParallelLinear, and UnfusedRowParallelLinear = matmul, then
  all_reduce, then bias); converted by replace_row_parallel(model, patterns=["*.o_proj", "*.down_proj"]), and
  replace_column_parallel(model, patterns=[... q/k/v/gate/up ...]): the column-parallel layers' backward all-reduce
  of the input gradient becomes one gemm_allreduce with the GEMM that produces it.
- sp: DTensor with sequence parallelism (torch's Llama recipe): SequenceParallel on both norms, ColwiseParallel(
  input_layouts=Shard(1)) for q/k/v/gate/up (all-gather of the sequence, then the GEMM) and RowwiseParallel(
  output_layouts=Shard(1)) for o_proj/down_proj (the GEMM, then a reduce-scatter); the block's input and output are
  each rank's chunk of the sequence. Converted by replace_sequence_parallel(model): allgather_gemm and
  gemm_reduce_scatter.
Converted (dtensor, plain), the block fuses o_proj's all-reduce with the residual add and post_attention_layernorm
(RowParallelLinear.forward(x, residual, norm) -> torch_gemm_ar.gemm_allreduce_add_rmsnorm).
For each style the script checks that the outputs agree, runs a few training steps (forward + backward + SGD) on
both models and checks that the weights agree, then prints forward and training-step times side by side.
The model classes are importable (tests/test_nn_*.py use them); nothing runs on import.
"""
import argparse
import copy
import math
import os
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------------------------------------------
# The single-device model (HF Llama module names, so the patterns read like real ones).
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class BlockConfig:
    hidden: int = 512
    heads: int = 8
    ffn: int = 1376
    bias: bool = False  # Llama has none; True exercises the add-the-bias-once path
    eps: float = 1e-5
    rope_theta: float = 10000.0

    def check(self, world: int) -> None:
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden={self.hidden} must split into {self.heads} heads of even size")
        if self.heads % world or self.ffn % world:
            raise ValueError(f"heads={self.heads} and ffn={self.ffn} must be divisible by the world size {world}")


def apply_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding on [B, heads, S, head_dim] (rotate-half form)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x):
        return self.o_proj(self.heads_output(x))

    def heads_output(self, x):
        """The attention's output before o_proj: [B, S, this rank's heads * head_dim]."""
        batch, seq, _ = x.shape

        def heads(t):  # the head count comes from the shape: all heads, or this rank's heads under TP
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q = apply_rotary(heads(self.q_proj(x)), self.rope_theta)
        k = apply_rotary(heads(self.k_proj(x)), self.rope_theta)
        v = heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(batch, seq, -1)


class MLP(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        heads = self.self_attn.heads_output(self.input_layernorm(x))
        o_proj = self.self_attn.o_proj
        if getattr(o_proj, "fuses_add_rmsnorm", False):
            # Converted: o_proj's all-reduce, the residual add and the next RMSNorm in one op
            # (torch_gemm_ar.gemm_allreduce_add_rmsnorm).
            x, normed = o_proj(heads, x, self.post_attention_layernorm)
        else:
            x = x + o_proj(heads)
            normed = self.post_attention_layernorm(x)
        return x + self.mlp(normed)


def make_block(cfg: BlockConfig, seed: int, dtype=torch.float32) -> DecoderBlock:
    """The same full block on every rank (same seed); biases and norm weights randomised so they matter."""
    torch.manual_seed(seed)
    block = DecoderBlock(cfg).to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "layernorm" in name else 0.0))
    return block


# ---------------------------------------------------------------------------------------------------------------
# Unfused tensor parallelism written by hand, Megatron-LM style. Functional collectives (c10d_functional ops) keep
# it traceable by torch.compile.
# ---------------------------------------------------------------------------------------------------------------
def _all_reduce_sum(t: torch.Tensor, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(t.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class CopyToTensorParallel(torch.autograd.Function):
    """Entering the TP region: identity forward; backward sums the ranks' input gradients (Megatron's copy-to)."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad, ctx.group_name), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Leaving the TP region: all_reduce forward; identity backward (the output gradient is replicated)."""

    @staticmethod
    def forward(ctx, x, group_name):
        return _all_reduce_sum(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class UnfusedColumnParallelLinear(nn.Module):
    """weight [out/world, in], bias [out/world]: this rank's slice of the output features."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = linear.out_features // world
        self.group_name = group.group_name
        self.weight = nn.Parameter(linear.weight.detach()[rank * rows:(rank + 1) * rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach()[rank * rows:(rank + 1) * rows].clone())

    def forward(self, x):
        return F.linear(CopyToTensorParallel.apply(x, self.group_name), self.weight, self.bias)


class UnfusedRowParallelLinear(nn.Module):
    """weight [out, in/world], bias [out]: matmul, then all_reduce, then the bias once (Megatron / DeepSpeed)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        cols = linear.in_features // world
        self.group_name = group.group_name
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        out = ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group_name)
        return out if self.bias is None else out + self.bias


COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
COLUMN_PARALLEL_PATTERNS = ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"]
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
ROW_PARALLEL_PATTERNS = ["*.o_proj", "*.down_proj"]


def tensor_parallel_plain(block: DecoderBlock, group: dist.ProcessGroup) -> DecoderBlock:
    """A copy of `block` sharded Megatron-style over `group` (unfused)."""
    block = copy.deepcopy(block)
    for name in COLUMN_PARALLEL + ROW_PARALLEL:
        parent_name, _, leaf = name.rpartition(".")
        parent = block.get_submodule(parent_name)
        layer = UnfusedColumnParallelLinear if name in COLUMN_PARALLEL else UnfusedRowParallelLinear
        setattr(parent, leaf, layer(getattr(parent, leaf), group))
    return block


def tensor_parallel_dtensor(block: DecoderBlock, mesh) -> DecoderBlock:
    """A copy of `block` parallelized with torch.distributed.tensor.parallel (unfused)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in COLUMN_PARALLEL}
    plan.update({name: RowwiseParallel() for name in ROW_PARALLEL})
    return parallelize_module(copy.deepcopy(block), mesh, plan)


def tensor_parallel_sequence(block: DecoderBlock, mesh) -> DecoderBlock:
    """A copy of `block` parallelized with sequence parallelism on [B, S, H] (unfused): input and output are this
    rank's chunk of the sequence."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
    plan.update({name: ColwiseParallel(input_layouts=Shard(1)) for name in COLUMN_PARALLEL})
    plan.update({name: RowwiseParallel(output_layouts=Shard(1)) for name in ROW_PARALLEL})
    return parallelize_module(copy.deepcopy(block), mesh, plan)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local value of a parameter or gradient, DTensor or not."""
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------------------------------------------------------
# The comparison script.
# ---------------------------------------------------------------------------------------------------------------
def _use_benchkit() -> None:
    """Makes the benchmarks' timing helpers (benchmarks/benchkit, next to this directory) importable."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)


def interleaved_times(fns, warmup: int, iters: int, group) -> list:
    """Per function of `fns`, its time per iteration in seconds, by the benchmarks' conventions
    (benchmarks/benchkit/timing.py: interleaved so load from elsewhere hits every variant alike, in orders where each
    variant follows every other equally often, each iteration counted from its last rank's start to its last rank's
    end). The warm-up runs `warmup` rounds, then more until `auto` has finished tuning every shape the functions meet
    (its tuning calls time each algorithm)."""
    import torch_gemm_ar

    _use_benchkit()
    from benchkit.timing import time_callables

    def one_round():
        for fn in fns:
            fn()

    torch_gemm_ar.tuning.warm_up_until_tuned(one_round, warmup)
    return time_callables(fns, warmup=0, iters=iters, group=group)


def speedup_text(unfused_s: list, converted_s: list) -> str:
    """unfused / converted per iteration (the two ran moments apart): the median, and its 95% bootstrap interval."""
    _use_benchkit()
    from benchkit.metrics import paired_speedup

    paired = paired_speedup(unfused_s, converted_s)
    return f"{paired['estimate']:.2f} ({paired['low']:.2f}-{paired['high']:.2f})"


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    params_b = dict(b.named_parameters())
    worst = 0.0
    for name, p in a.named_parameters():
        worst = max(worst, (local_tensor(p).detach().double() - local_tensor(params_b[name]).detach().double())
                    .abs().max().item())
    return worst


def compare_style(style: str, args, cfg: BlockConfig, dtype, group, mesh) -> dict:
    import torch_gemm_ar

    full = make_block(cfg, args.seed, dtype)
    make_tp = {"dtensor": lambda: tensor_parallel_dtensor(full, mesh), "plain": lambda: tensor_parallel_plain(full, group),
               "sp": lambda: tensor_parallel_sequence(full, mesh)}[style]
    unfused, converted = make_tp(), make_tp()
    # The optimizer is built before the conversion: the converted layers adopt the same Parameter objects.
    opt_unfused = torch.optim.SGD(unfused.parameters(), lr=args.lr, momentum=0.9)
    opt_converted = torch.optim.SGD(converted.parameters(), lr=args.lr, momentum=0.9)
    if style == "sp":
        replaced = torch_gemm_ar.nn.replace_sequence_parallel(converted, algorithm=args.algorithm)
    else:
        patterns = None if style == "dtensor" else ROW_PARALLEL_PATTERNS
        replaced = torch_gemm_ar.nn.replace_row_parallel(converted, group=group, patterns=patterns,
                                                         algorithm=args.algorithm)
        # The column-parallel layers: their backward all-reduce of the input gradient becomes a gemm_allreduce.
        column_patterns = None if style == "dtensor" else COLUMN_PARALLEL_PATTERNS
        replaced += torch_gemm_ar.nn.replace_column_parallel(converted, group=group, patterns=column_patterns,
                                                             algorithm=args.algorithm)

    generator = torch.Generator().manual_seed(args.seed + 1)  # the same activations on every rank (replicated)
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    def batch():
        x = torch.randn(args.batch, args.seq, cfg.hidden, generator=generator).to(dtype)
        target = torch.randn(args.batch, args.seq, cfg.hidden, generator=generator).to(dtype)
        if style == "sp":  # this rank's chunk of the sequence
            return x.chunk(world, dim=1)[rank].contiguous(), target.chunk(world, dim=1)[rank].contiguous()
        return x, target

    with torch.no_grad():
        x, _ = batch()
        forward_diff = (unfused(x).double() - converted(x).double()).abs().max().item()
    for _ in range(args.steps):
        x, target = batch()
        for model, opt in ((unfused, opt_unfused), (converted, opt_converted)):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x).float(), target.float()).backward()
            opt.step()
    weight_diff = _max_difference(unfused, converted)

    x, target = batch()

    def forward(model):
        with torch.no_grad():
            model(x)

    def train_step(model, opt):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x).float(), target.float()).backward()
        opt.step()

    pairs = ((unfused, opt_unfused), (converted, opt_converted))
    forward_s = interleaved_times([lambda m=m: forward(m) for m, _ in pairs], args.warmup, args.iters, group)
    step_s = interleaved_times([lambda m=m, o=o: train_step(m, o) for m, o in pairs], args.warmup, args.iters, group)
    timing = {"forward": forward_s, "train step": step_s}  # each [unfused, converted], seconds per iteration
    return {"replaced": replaced, "forward_diff": forward_diff, "weight_diff": weight_diff, "timing": timing}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--style", choices=["dtensor", "plain", "sp", "all"], default="all")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--bias", action="store_true", help="give every linear layer a bias")
    parser.add_argument("--steps", type=int, default=3, help="training steps compared")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (median and per-iteration speedup reported)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    if "RANK" not in os.environ:
        print("run with torchrun, e.g.: torchrun --nproc-per-node 2 examples/tp_transformer.py", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = BlockConfig(hidden=args.hidden, heads=args.heads, ffn=args.ffn, bias=args.bias)
    cfg.check(world)
    dtype = getattr(torch, args.dtype)
    group = dist.group.WORLD
    mesh = None
    styles = ["dtensor", "plain", "sp"] if args.style == "all" else [args.style]
    if "sp" in styles and args.seq % world:
        if args.style == "sp":
            raise SystemExit(f"--seq {args.seq} must be divisible by the world size {world} for sequence parallelism")
        # A decode step (--seq 1) has no sequence to split: run the other styles.
        styles.remove("sp")
        if rank == 0:
            print(f"skipping style sp: --seq {args.seq} is not divisible by the world size {world}")
    if "dtensor" in styles or "sp" in styles:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        group = mesh.get_group()

    # The comparison tolerance: products of unit-scale values summed over the hidden dimension.
    tolerance = (2e-4 if dtype == torch.float32 else 6e-2) * math.sqrt(cfg.hidden / 64)
    failed = False
    for style in styles:
        result = compare_style(style, args, cfg, dtype, group, mesh)
        ok = result["forward_diff"] <= tolerance and result["weight_diff"] <= tolerance
        failed |= not ok
        if rank == 0:
            print(f"\n== {style}: {world} ranks, tokens={args.batch * args.seq}, hidden={cfg.hidden}, ffn={cfg.ffn}, "
                  f"{args.dtype}, algorithm={args.algorithm}")
            print(f"replaced: {', '.join(result['replaced'])}")
            print(f"max |unfused - converted|: output {result['forward_diff']:.3g}, weights after {args.steps} "
                  f"SGD steps {result['weight_diff']:.3g} (tolerance {tolerance:.3g}): {'OK' if ok else 'MISMATCH'}")
            print(f"{'median ms':<14}{'unfused':>10}{'converted':>11}  speedup (95% interval)")
            for name, (unfused_s, converted_s) in result["timing"].items():
                print(f"{name:<14}{statistics.median(unfused_s) * 1e3:>10.2f}"
                      f"{statistics.median(converted_s) * 1e3:>11.2f}  {speedup_text(unfused_s, converted_s)}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
