"""Megatron-core's own tensor-parallel MLP (ColumnParallelLinear -> GELU -> RowParallelLinear) on CPU ranks, as
Megatron runs it and converted by torch_gemm_ar.nn.replace_megatron (found by type, no names):

    torchrun --nproc-per-node 2 examples/megatron_tp.py

`--model gpt`: a 2-layer GPTModel (SwiGLU, RMSNorm, Megatron's local layer spec) instead of the MLP.
Prints the converted modules, the largest output difference, the weights after one SGD step compared, and the
median times per forward and per train step of both and their paired speedup with its 95% interval
(the benchmarks' interleaved timing), with the CPU's name. Exits non-zero
when a difference is beyond fp32 tolerance. Needs megatron-core 0.19.2 (`pip install --no-deps
--ignore-requires-python megatron-core==0.19.2`; it runs on Python 3.11). On CPU: Megatron imports a triton-only MoE
module at import time, stubbed here (the MLP never calls it); weights initialized on CPU; no
gradient_accumulation_fusion (a CUDA kernel). For the GPT model also: Megatron's inference RNG tracker (its default
forks CUDA RNG states; dropout is 0), torch.cuda.current_device() answering "cpu" (Megatron allocates its attention
scratch buffer there), a causal mask built on CPU, learned position embeddings, its fused kernels off.
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
from megatron_cpu import stub_triton_only_module  # noqa: E402
from tp_transformer import interleaved_times, speedup_text  # noqa: E402  (the benchmarks' timing)

def build_mlp(seed, hidden, ffn, config):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)
    init = torch.nn.init.xavier_normal_
    mlp = torch.nn.Module()
    mlp.fc1 = ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=True, gather_output=False,
                                   skip_bias_add=True)
    mlp.fc2 = RowParallelLinear(ffn, hidden, config=config, init_method=init, bias=True, input_is_parallel=True,
                                skip_bias_add=False)
    return mlp


def run(mlp, x):
    h, bias = mlp.fc1(x)
    out, _ = mlp.fc2(torch.nn.functional.gelu(h + bias))
    return out


def build_gpt(seed, hidden, ffn, tokens, vocab=1024):
    """A 2-layer GPTModel, and the function that runs it on a [1, tokens] batch of token ids `x`."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.cuda.current_device = lambda: "cpu"
    config = TransformerConfig(num_layers=2, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=8,
                               use_cpu_initialization=True, gradient_accumulation_fusion=False,
                               normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
                               apply_rope_fusion=False, persist_layer_norm=False)
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=vocab, max_sequence_length=tokens, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=False)
    positions = torch.arange(tokens).unsqueeze(0)
    causal = torch.triu(torch.ones(1, 1, tokens, tokens, dtype=torch.bool), diagonal=1)
    return model, lambda net, x: net(x, positions, causal)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=512, help="sequence length (batch 1)")
    parser.add_argument("--reps", type=int, default=20, help="timed iterations per variant")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    stub_triton_only_module()
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    import torch_gemm_ar

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    g = torch.Generator().manual_seed(1)
    if args.model == "mlp":
        config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
                                   use_cpu_initialization=True, gradient_accumulation_fusion=False)
        megatron_model = build_mlp(0, args.hidden, args.ffn, config)
        converted = build_mlp(0, args.hidden, args.ffn, config)
        x = torch.randn(args.tokens, 1, args.hidden, generator=g)
        upstream = torch.randn(args.tokens, 1, args.hidden, generator=g)
        forward_of = run
    else:
        (megatron_model, forward_of), (converted, _) = (build_gpt(0, args.hidden, args.ffn, args.tokens),
                                                      build_gpt(0, args.hidden, args.ffn, args.tokens))
        x = torch.randint(0, 1024, (1, args.tokens), generator=g)
        upstream = torch.randn(1, args.tokens, 1024 // world, generator=torch.Generator().manual_seed(2 + rank))
    report = torch_gemm_ar.nn.replace_megatron(converted)
    if rank == 0:
        print(report)

    def run_input(net, x):
        return forward_of(net, x.clone().requires_grad_() if x.is_floating_point() else x)

    ok = True
    with torch.no_grad():
        diff = (forward_of(converted, x) - forward_of(megatron_model, x)).abs().max().item()
    ok &= diff <= 1e-4
    for net in (megatron_model, converted):  # one SGD step each on the same batch
        (run_input(net, x) * upstream).sum().backward()
        torch.optim.SGD(net.parameters(), lr=1e-3).step()
        net.zero_grad()
    weights = dict(megatron_model.named_parameters())
    step_diff = max((p - weights[n]).abs().max().item() for n, p in converted.named_parameters())
    ok &= step_diff <= 1e-5

    def forward(net):
        def call():
            with torch.no_grad():
                forward_of(net, x)
        return call

    def train_step(net):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.0)  # lr 0: the weights stay comparable

        def call():
            (run_input(net, x) * upstream).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return call

    # The benchmarks' timing (interleaved; the warm-up lasts until `auto` decided every shape the step meets).
    fwd_s = interleaved_times([forward(megatron_model), forward(converted)], 1, args.reps, None)
    train_s = interleaved_times([train_step(megatron_model), train_step(converted)], 1, args.reps, None)
    if rank == 0:
        print(f"CPU: {cpu_model()}; {world} ranks x {torch.get_num_threads()} threads; {args.model}, tokens "
              f"{args.tokens}, hidden {args.hidden}, ffn {args.ffn}")
        print(f"largest output difference from Megatron: {diff:.3g}; weights after one SGD step: {step_diff:.3g}")
        for what, (megatron_s, converted_s) in (("forward:   ", fwd_s), ("train step:", train_s)):
            print(f"{what} Megatron {statistics.median(megatron_s) * 1e3:.2f} ms, converted "
                  f"{statistics.median(converted_s) * 1e3:.2f} ms, speedup {speedup_text(megatron_s, converted_s)}")
        print(f"(median of {args.reps} iterations per variant, interleaved; speedup = Megatron / converted per "
              "iteration, with its 95% interval)")
        print("OK" if ok else "FAILED: a difference beyond fp32 tolerance")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
