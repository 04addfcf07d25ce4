"""torchtitan's own Llama3 and tensor-parallel plan on CPU ranks, unconverted and converted by
torch_gemm_ar.nn.replace_torchtitan -- no change to torchtitan's code or configs.

    torchrun --nproc-per-node 2 examples/titan_llama_tp.py

The model is built from torchtitan 0.3.0's Llama3 configs with random weights (its init_states; nothing is
downloaded), its sharding configs set by `set_llama3_sharding_config` (sequence parallelism on, torchtitan's
default; --no-sp for off; one fused wqkv projection as in its Llama3 flavours, --qkv separate for wq/wk/wv) and
parallelized by `Module.parallelize` over gloo, with the `spmd_types` SPMD backend
(torchtitan's default; --backend partial_dtensor for DTensors). The CPU-only workarounds are in
examples/titan_llama.py. The script prints what was converted (and why the rest was not), the largest logit
difference from the unconverted TP model, and the median time per forward and per train step (forward, backward,
SGD) of both, interleaved, with the speedup; it exits non-zero when a difference is beyond the tolerance.

    torchrun --nproc-per-node 2 examples/titan_llama_tp.py --compile inductor

compares instead torchtitan's model as it comes, compiled twice: without the project's rewrite, and with it
(`torch_gemm_ar.compile.backend(inner=...)`; `--compile eager` runs AOT autograd's graphs without Inductor). It
prints what the rewrite fused and left alone (`torch_gemm_ar.compile.report()`), and the same differences and times.
Needs `pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0
typeguard==4.6.1` (.ci/run installs the same).
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "benchmarks"))

from benchkit.dist_env import cpu_model  # noqa: E402
from tp_transformer import interleaved_times, speedup_text  # noqa: E402  (the benchmarks' timing)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["spmd_types", "partial_dtensor"], default="spmd_types")
    parser.add_argument("--no-sp", action="store_true", help="sequence parallelism off")
    parser.add_argument("--qkv", choices=["fused", "separate"], default="fused",
                        help="one wqkv projection (torchtitan's Llama3 flavours) or wq/wk/wv")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1376)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--algorithm", default="auto", help="torch_gemm_ar algorithm of the converted layers")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per variant (median reported)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--compile", choices=["none", "inductor", "eager"], default="none",
                        help="compare torchtitan's model compiled without and with the rewrite (no conversion)")
    args = parser.parse_args(argv)
    if args.compile != "none" and args.algorithm != "auto":
        parser.error(f"--algorithm {args.algorithm} with --compile {args.compile}: --algorithm applies to the "
                     "converted layers (--compile none); the compile rewrite's ops run with auto")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run with torchrun, e.g.: torchrun --nproc-per-node 2 examples/titan_llama_tp.py", file=sys.stderr)
        return 2
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("needs torchtitan: pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 "
              "docstring-parser==0.18.0 typeguard==4.6.1", file=sys.stderr)
        return 2
    import torch_gemm_ar
    from titan_llama import backend, build, local

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sp = not args.no_sp
    shape = dict(dim=args.dim, heads=args.heads, kv_heads=args.kv_heads, hidden=args.hidden, vocab=args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed))
    with backend(args.backend):
        models, contexts = zip(*(build(args.backend, sp, world, args.seed, args.layers, fuse_qkv=args.qkv == "fused",
                                       shape=shape) for _ in "ab"))
        context = contexts[0]
        if args.compile == "none":
            report = torch_gemm_ar.nn.replace_torchtitan(models[1], algorithm=args.algorithm)
            names = ("torchtitan TP", "converted")
        else:
            torch_gemm_ar.compile.reset()
            plain = "inductor" if args.compile == "inductor" else "aot_eager"
            models = (torch.compile(models[0], backend=plain),
                      torch.compile(models[1], backend=torch_gemm_ar.compile.backend(inner=args.compile)))
            names = ("compiled", "+ rewrite")
        # Built after the conversion is as good as before it: the converted modules keep their Parameter objects.
        optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
        with context():
            def gradients_only():  # forward and backward without a step: the weights stay as in the other model
                local(models[1](ids)).float().pow(2).mean().backward()
                optimizers[1].zero_grad(set_to_none=True)

            # `auto` times its candidates in the first calls of each shape: decide every bucket before timing.
            with torch.no_grad():
                torch_gemm_ar.tuning.warm_up_until_tuned(lambda: models[1](ids))
            torch_gemm_ar.tuning.warm_up_until_tuned(gradients_only)
            with torch.no_grad():
                logits = [local(m(ids)).clone() for m in models]
                forward_s = interleaved_times([lambda m=m: m(ids) for m in models], args.warmup, args.iters, None)

            def step(model, optimizer):
                optimizer.zero_grad(set_to_none=True)
                local(model(ids)).float().pow(2).mean().backward()  # a loss over this rank's vocabulary shard
                optimizer.step()

            step_s = interleaved_times([lambda m=m, o=o: step(m, o) for m, o in zip(models, optimizers)],
                                       args.warmup, args.iters, None)
            with torch.no_grad():
                after = [local(m(ids)) for m in models]
    if args.compile != "none":
        report = f"torch_gemm_ar.compile ({args.compile}): {torch_gemm_ar.compile.report()}"
    diff = (logits[1] - logits[0]).abs().max().item()
    after_diff = (after[1] - after[0]).abs().max().item()
    scale = max(1.0, logits[0].abs().max().item())
    # Both models took the same steps (same batch, same order); rounding differs by the fused ops' summation order.
    tolerance, after_tolerance = 1e-4 * scale, 1e-3 * scale
    ok = diff <= tolerance and after_diff <= after_tolerance
    if rank == 0:
        sp_text = "sequence parallel" if sp else "no sequence parallelism"
        print(f"\ntorchtitan Llama3, {args.layers} layers, dim {args.dim}, ffn {args.hidden}, heads {args.heads}/"
              f"{args.kv_heads} ({args.qkv} qkv), vocab {args.vocab}; batch {args.batch} x seq {args.seq}; {world} ranks, "
              f"{args.backend}, {sp_text}")
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
        print(report)
        reference = "torchtitan's TP" if args.compile == "none" else "the model compiled without the rewrite"
        print(f"max |logit difference| from {reference}: {diff:.3g} (tolerance {tolerance:.3g}); after "
              f"the same train steps: {after_diff:.3g} (tolerance "
              f"{after_tolerance:.3g}): {'ok' if ok else 'BEYOND TOLERANCE'}")
        print(f"\n{'':<14}{names[0]:>14}{names[1]:>12}  speedup (95% interval)")
        for name, times in (("ms/forward", forward_s), ("ms/train step", step_s)):
            print(f"{name:<14}{statistics.median(times[0]) * 1e3:>14.2f}{statistics.median(times[1]) * 1e3:>12.2f}"
                  f"  {speedup_text(times[0], times[1])}")
        print(f"(median of {args.iters} iterations per variant, interleaved; speedup = {names[0]} / {names[1]} per "
              "iteration)")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
