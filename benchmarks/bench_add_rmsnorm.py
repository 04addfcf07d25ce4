"""The fused add+RMSNorm epilogue (gemm_allreduce_add_rmsnorm) against gemm_allreduce alone and against
gemm_allreduce followed by torch's add and torch.nn.functional.rms_norm, interleaved round-robin on the same inputs.

    torchrun --nproc-per-node 2 benchmarks/bench_add_rmsnorm.py [--shapes 4096x256x2048,16x256x2048] [--dtype bf16]

Issue 13's target on the CPU engine: fused epilogue / gemm_allreduce alone <= 1.03 at M4096 K256 N2048.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_gemm_ar

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="4096x256x2048,64x256x2048,1x256x2048")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--algorithm", default="fused")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, dtype = dist.get_rank(), DTYPES[args.dtype]
    rows = []
    for item in args.shapes.split(","):
        m, k, n = (int(v) for v in item.split("x"))
        g = torch.Generator().manual_seed(rank)
        a = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(k, n, generator=torch.Generator().manual_seed(1)).to(dtype)
        residual = torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(dtype)
        w = torch.ones(n, dtype=dtype)
        variants = {
            "gemm_allreduce": lambda: torch_gemm_ar.gemm_allreduce(a, b, algorithm=args.algorithm),
            "unfused": lambda: F.rms_norm(torch_gemm_ar.gemm_allreduce(a, b, algorithm=args.algorithm) + residual,
                                          (n,), w, 1e-6),
            "fused_epilogue": lambda: torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, b, residual, w, eps=1e-6,
                                                                              algorithm=args.algorithm),
        }
        times = {name: [] for name in variants}
        for it in range(args.warmup + args.iters):
            for name, fn in variants.items():  # round-robin: load changes hit every variant alike
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                if it >= args.warmup:
                    times[name].append(elapsed)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append((f"M{m} K{k} N{n} {args.dtype}", med))
    if rank == 0:
        print(f"world {dist.get_world_size()}, algorithm={args.algorithm}, median of {args.iters}")
        print("| shape | gemm_allreduce ms | +add+rms_norm (torch) ms | fused epilogue ms | fused/alone | fused/unfused |")
        print("|---|---|---|---|---|---|")
        for shape, med in rows:
            alone, unfused, fused = med["gemm_allreduce"], med["unfused"], med["fused_epilogue"]
            print(f"| {shape} | {alone * 1e3:.2f} | {unfused * 1e3:.2f} | {fused * 1e3:.2f} | {fused / alone:.3f} | "
                  f"{fused / unfused:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
