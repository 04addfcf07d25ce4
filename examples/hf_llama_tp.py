"""A Hugging Face Llama loaded with transformers' tensor parallelism (tp_plan="auto") on CPU ranks, three ways:
unconverted, converted eagerly by torch_gemm_ar.nn.replace_row_parallel, and compiled with the torch.compile rewrite
(torch_gemm_ar.compile) -- no change to the model's code in either case.

    torchrun --nproc-per-node 2 examples/hf_llama_tp.py

A small Llama config is made here and saved with random weights to a temporary directory (nothing is downloaded),
then every rank loads it with `AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")` over gloo. The script
prints each variant's largest logit difference from the unconverted TP model and from a float64 single-process
reference, and the median time per forward (variants interleaved round-robin; with Inductor, the same model compiled
without the rewrite as well), and exits non-zero when a difference is beyond the tolerance. Then training: the
unconverted model against one converted by replace_row_parallel and replace_column_parallel (the column-parallel
layers' backward all-reduce fused too), one SGD step each on the same batch (their weights compared), and the
median time per train step. Needs `pip install transformers accelerate` (the project's test extra has them).
"""
import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "benchmarks"))

from benchkit.dist_env import cpu_model  # noqa: E402
from tp_transformer import interleaved_times, speedup_text  # noqa: E402  (the benchmarks' timing)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--algorithm", default="auto", help="torch_gemm_ar algorithm of the eager conversion")
    parser.add_argument("--compile-inner", choices=["inductor", "eager"], default="inductor",
                        help="what runs the rewritten graphs: Inductor (post-grad pass), or AOT's aten graphs as they "
                        "are (fast to compile)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10, help="timed forwards per variant (median reported)")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def save_tiny_llama(args, path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(64, args.seq))
    torch.manual_seed(args.seed)
    LlamaForCausalLM(config).save_pretrained(path)


def load_tp(path: str, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    return model.eval()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_steps(path: str, dtype, ids, args):
    """Unconverted TP against the model converted for training (rows and columns): one SGD step each on the same
    batch, then interleaved timed steps. Returns (the column converter's report, the largest weight difference after
    the first step, the per-iteration times [unconverted, converted])."""
    import torch_gemm_ar

    models = [load_tp(path, dtype).train(), load_tp(path, dtype).train()]
    # Built before the conversion: the converted layers adopt the same Parameter objects.
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    torch_gemm_ar.nn.replace_row_parallel(models[1], algorithm=args.algorithm)
    columns = torch_gemm_ar.nn.replace_column_parallel(models[1], algorithm=args.algorithm)

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        optimizer.step()

    for model, optimizer in zip(models, optimizers):
        step(model, optimizer)
    converted = dict(models[1].named_parameters())
    diff = max((_local(p).double() - _local(converted[n]).double()).abs().max().item()
               for n, p in models[0].named_parameters())
    def gradients_only():  # forward and backward without a step: the weights stay as in the unconverted model
        models[1](ids, labels=ids).loss.backward()
        optimizers[1].zero_grad(set_to_none=True)

    # `auto` times its candidates in the first calls of each shape: decide every bucket before timing.
    torch_gemm_ar.tuning.warm_up_until_tuned(gradients_only)
    times = interleaved_times([lambda m=m, o=o: step(m, o) for m, o in zip(models, optimizers)], args.warmup,
                              args.iters, None)
    return columns, diff, times


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run with torchrun, e.g.: torchrun --nproc-per-node 2 examples/hf_llama_tp.py", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("needs transformers and accelerate: pip install transformers accelerate", file=sys.stderr)
        return 2
    import torch_gemm_ar

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = getattr(torch, args.dtype)

    holder = [tempfile.mkdtemp(prefix="hf_llama_tp_") if rank == 0 else None]
    dist.broadcast_object_list(holder)  # one directory, written by rank 0 (all ranks of torchrun share a host)
    path = holder[0]
    try:
        if rank == 0:
            save_tiny_llama(args, path)
        dist.barrier()
        generator = torch.Generator().manual_seed(args.seed + 1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)  # the same on every rank
        from transformers import AutoModelForCausalLM

        with torch.no_grad():
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()(ids).logits
            unconverted = load_tp(path, dtype)
            converted = load_tp(path, dtype)
            report = torch_gemm_ar.nn.replace_row_parallel(converted, algorithm=args.algorithm)
            variants = {"unconverted TP": unconverted, "converted (eager)": converted}
            if args.compile_inner == "inductor":
                # Every graph compiled here, not taken from an earlier run's cache: the rewrite counts are this run's.
                torch._inductor.config.force_disable_caches = True
                # The same compiler without the rewrite, for a fair comparison.
                variants["compiled, no rewrite (inductor)"] = torch.compile(load_tp(path, dtype))
            logits = {name: model(ids).logits for name, model in variants.items()}  # compiles, first call
            torch_gemm_ar.compile.reset()
            name = f"compiled + rewrite ({args.compile_inner})"
            variants[name] = torch.compile(load_tp(path, dtype),
                                           backend=torch_gemm_ar.compile.backend(inner=args.compile_inner))
            logits[name] = variants[name](ids).logits
            rewrites = torch_gemm_ar.compile.report()
            # `auto` times its candidates in the first calls of each shape: decide every bucket before timing.
            for model in list(variants.values())[1:]:
                torch_gemm_ar.tuning.warm_up_until_tuned(lambda m=model: m(ids))
            times = interleaved_times([lambda m=m: m(ids) for m in variants.values()], args.warmup, args.iters, None)
        columns, weight_diff, step_times = train_steps(path, dtype, ids, args)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    base = logits["unconverted TP"].double()
    # Logits are sums over the hidden dim of unit-scale products, through every layer.
    tolerance = (1e-4 if dtype == torch.float32 else 5e-2) * math.sqrt(args.hidden / 64) * args.layers
    rows, failed = [], False
    for (name, out), iteration_s in zip(logits.items(), times):
        vs_tp = (out.double() - base).abs().max().item()
        vs_ref = (out.double() - reference).abs().max().item()
        failed |= vs_tp > tolerance
        rows.append((name, vs_tp, vs_ref, iteration_s))
    weight_tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # one SGD step of lr 1e-3 on both
    failed |= weight_diff > weight_tolerance
    if rank == 0:
        print(f"\nLlama, {args.layers} layers, hidden {args.hidden}, ffn {args.intermediate}, heads {args.heads}/"
              f"{args.kv_heads} kv, vocab {args.vocab}; {args.batch}x{args.seq} tokens, {args.dtype}; {world} ranks "
              f"(gloo), torch {torch.__version__}, transformers {transformers.__version__}")
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
        print(report)
        print(f"torch.compile rewrite: {rewrites}")
        width = max(len(r[0]) for r in rows) + 2
        print(f"\n{'variant':<{width}}{'max |d| vs TP':>15}{'vs float64':>13}{'ms/forward':>12}  speedup (95% interval)")
        for name, vs_tp, vs_ref, iteration_s in rows:
            print(f"{name:<{width}}{vs_tp:>15.3g}{vs_ref:>13.3g}{statistics.median(iteration_s) * 1e3:>12.2f}  "
                  f"{speedup_text(rows[0][3], iteration_s)}")
        print(f"(median of {args.iters} forwards per variant, interleaved; speedup over unconverted TP per iteration; "
              f"tolerance vs TP {tolerance:.3g}: "
              f"{'MISMATCH' if any(r[1] > tolerance for r in rows) else 'OK'})")
        print(f"\ntraining (forward + backward + SGD), converted by replace_row_parallel and {columns}")
        print(f"max |weight difference| after one step: {weight_diff:.3g} (tolerance {weight_tolerance:.3g}): "
              f"{'MISMATCH' if weight_diff > weight_tolerance else 'OK'}")
        print(f"{'train step':<{width}}{'unconverted':>15}{'converted':>13}  speedup (95% interval)")
        print(f"{'ms/step':<{width}}{statistics.median(step_times[0]) * 1e3:>15.2f}"
              f"{statistics.median(step_times[1]) * 1e3:>13.2f}  {speedup_text(step_times[0], step_times[1])}")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
