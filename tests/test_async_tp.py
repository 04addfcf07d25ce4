"""torch's async-TP ops on the engine (torch_gemm_ar.async_tp): symm_mem's fused_all_gather_matmul and
fused_matmul_reduce_scatter on CPU against float64 references and against the layout of torch's own reference
kernel; and a DTensor sequence-parallel MLP compiled with Inductor's micro-pipeline TP, whose compiled code calls
them, forward and gradients equal to the eager TP model's."""
import pytest
import torch
import torch.distributed as dist

from inputs import TOLERANCE, assert_matches


def randn(seed, *shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# (a shard's shape for world W, the gathered or scattered dim): 2-D and 3-D, row dims and the last dim (which runs
# as the collective, then the matmul), odd sizes. Dims are given as Inductor's pass gives them, non-negative (torch's
# reference kernel, whose strides the outputs must have, mis-shapes a negative gather_dim).
def layouts(world):
    return [((world * 7, 33), 0), ((3, world * 5, 65), 1), ((world * 2, 5, 17), 0), ((5, 33), 1)]


def _meta_layout(op, *args, **kwargs):
    """The strides of torch's own reference kernel for these arguments (its Meta kernel runs the same code)."""
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else
            [b.to("meta") for b in a] if isinstance(a, list) else a for a in args]
    return op(*meta, **kwargs)


def all_gather_matmul_results(rank, world, seed, dtype):
    import torch_gemm_ar

    torch_gemm_ar.async_tp.register_kernels()
    name = dist.group.WORLD.group_name
    op = torch.ops.symm_mem.fused_all_gather_matmul
    checked = 0
    for li, (shape, dim) in enumerate(layouts(world)):
        shards = [randn(seed + 100 * li + r, *shape, dtype=dtype) for r in range(world)]
        want_a = torch.cat([s.double() for s in shards], dim=dim)
        k = want_a.shape[-1]  # world x the shard's K where the gather is along the last dim
        bs = [randn(seed + 100 * li + 50 + i, k, n, dtype=dtype) for i, n in enumerate((65, 1, 9))]
        for return_a in (True, False):
            got_a, outs = op(shards[rank], bs, dim, name, return_A=return_a)
            meta_a, meta_outs = _meta_layout(op, shards[rank], bs, dim, name, return_A=return_a)
            what = f"layout {li} dim={dim} return_A={return_a}"
            if return_a:
                torch.testing.assert_close(got_a.double(), want_a, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
                assert got_a.stride() == meta_a.stride(), f"{what}: A strides {got_a.stride()} != {meta_a.stride()}"
            else:
                assert got_a is None
            assert len(outs) == len(bs)
            for i, (out, b, meta) in enumerate(zip(outs, bs, meta_outs)):
                assert_matches(out, want_a @ b.double(), dtype, k, world, f"{what} B[{i}]")
                assert out.stride() == meta.stride(), f"{what} B[{i}]: strides {out.stride()} != {meta.stride()}"
            checked += 1
    return checked


def matmul_reduce_scatter_results(rank, world, seed, dtype):
    import torch_gemm_ar

    torch_gemm_ar.async_tp.register_kernels()
    name = dist.group.WORLD.group_name
    op = torch.ops.symm_mem.fused_matmul_reduce_scatter
    checked = 0
    for li, (shape, dim) in enumerate(layouts(world)):
        k, n = shape[-1], 3 * world + 2
        if dim % len(shape) == len(shape) - 1:
            n = 5 * world  # scattered along N: divisible by the world size
        shards = [randn(seed + 100 * li + r, *shape, dtype=dtype) for r in range(world)]
        weights = [randn(seed + 100 * li + 50 + r, k, n, dtype=dtype) for r in range(world)]
        full = sum(a.double() @ w.double() for a, w in zip(shards, weights))
        for reduce_op in ("sum", "avg"):
            out = op(shards[rank], weights[rank], reduce_op, dim, name)
            want = full.chunk(world, dim=dim)[rank] / (world if reduce_op == "avg" else 1)
            what = f"layout {li} dim={dim} {reduce_op}"
            assert_matches(out, want, dtype, k, world, what)
            meta = _meta_layout(op, shards[rank], weights[rank], reduce_op, dim, name)
            assert out.shape == meta.shape and out.stride() == meta.stride(), (
                f"{what}: shape {tuple(out.shape)} strides {out.stride()}, torch's {tuple(meta.shape)} {meta.stride()}")
            checked += 1
    try:
        op(shards[rank], weights[rank], "max", 0, name)
    except ValueError as e:
        assert "reduce_op must be 'sum' or 'avg'" in str(e), e
    else:
        raise AssertionError("reduce_op='max' was accepted")
    return checked


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_symm_mem_kernels_match_float64(ranks, world, dtype):
    assert ranks(world).run(all_gather_matmul_results, 11, dtype) == [8] * world
    assert ranks(world).run(matmul_reduce_scatter_results, 23, dtype) == [8] * world


def compiled_sequence_parallel_mlp(rank, world, enable):
    """A DTensor sequence-parallel MLP (w1 and w3 share one gathered input) compiled with Inductor's micro-pipeline TP
    (as torchtitan's async TP sets it up). Returns how many symm_mem fused ops the compiled code calls, and checks
    the output and the gradients against the same model run eagerly."""
    import warnings

    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    import torch_gemm_ar

    class MLP(torch.nn.Module):
        def __init__(self, d=64, h=96):
            super().__init__()
            self.norm = torch.nn.LayerNorm(d)
            self.w1 = torch.nn.Linear(d, h, bias=False)
            self.w3 = torch.nn.Linear(d, h, bias=False)
            self.w2 = torch.nn.Linear(h, d, bias=False)

        def forward(self, x):
            x = self.norm(x)
            return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    models = [MLP(), MLP()]
    models[1].load_state_dict(models[0].state_dict())
    plan = {"norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w3": ColwiseParallel(input_layouts=Shard(1)), "w2": RowwiseParallel(output_layouts=Shard(1))}
    for m in models:
        parallelize_module(m, mesh, plan)
    x = distribute_tensor(randn(7, 2, 8 * world, 64, dtype=torch.float32), mesh, [Shard(1)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates the switch; its pass still reads it
        enable_symm_mem_for_group(mesh.get_group().group_name)
    was = torch_gemm_ar.async_tp.is_enabled()
    if enable:
        torch_gemm_ar.async_tp.enable()
    try:
        with inductor_config.patch(_micro_pipeline_tp=True, fx_graph_cache=False):
            compiled = torch.compile(models[0])

            def step():
                out = compiled(x)
                if enable:  # the control (enable=False) needs the forward graph only
                    out.sum().backward()
                return out

            out, codes = run_and_get_code(step)
    finally:
        if enable and not was:
            torch_gemm_ar.async_tp.disable()
    want = models[1](x)
    torch.testing.assert_close(out, want, rtol=TOLERANCE[torch.float32], atol=1e-5)
    if enable:
        want.sum().backward()
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name}.grad: {m}")
    text = "\n".join(codes)
    return {op: text.count(f"symm_mem.{op}") for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")}


def test_micro_pipeline_tp_runs_on_the_engine(ranks):
    counts = ranks(2).run(compiled_sequence_parallel_mlp, True)
    for rank_counts in counts:
        assert rank_counts["fused_all_gather_matmul"] >= 1 and rank_counts["fused_matmul_reduce_scatter"] >= 1, counts
    if dist.is_nccl_available():
        return  # the control below holds where torch has no NCCL (the CPU wheel CI installs)
    # Negative control: without enable() torch's pass stops at its NCCL check, and nothing is fused.
    assert ranks(2).run(compiled_sequence_parallel_mlp, False) == [
        {"fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0}] * 2


def bad_operands_are_named(rank, world):
    """A B whose K does not match, on the last rank only: every rank raises, naming torch's op and the project's op
    that ran it, and the group still works after."""
    import torch_gemm_ar

    torch_gemm_ar.async_tp.register_kernels()
    name = dist.group.WORLD.group_name
    a = randn(3, 4 * world, 8, dtype=torch.float32)  # the same on every rank
    k = 9 if rank == world - 1 else 8
    cases = [(torch.ops.symm_mem.fused_all_gather_matmul, (a, [randn(4, k, 5, dtype=torch.float32)], 0, name),
              "symm_mem.fused_all_gather_matmul (run by torch_gemm_ar as pto.allgather_gemm)"),
             (torch.ops.symm_mem.fused_matmul_reduce_scatter, (a, randn(5, k, 5, dtype=torch.float32), "sum", 0, name),
              "symm_mem.fused_matmul_reduce_scatter (run by torch_gemm_ar as pto.gemm_reduce_scatter)")]
    messages = []
    for op, args, expected in cases:
        with pytest.raises(ValueError) as raised:
            op(*args)
        assert expected in str(raised.value), raised.value
        messages.append(str(raised.value))
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, torch.eye(8), "sum", 0, name)
    torch.testing.assert_close(out, a.chunk(world)[rank] * world)
    return messages


def test_bad_operands_raise_on_every_rank_naming_the_symm_mem_op(ranks):
    messages = ranks(2).run(bad_operands_are_named)
    for rank_messages in messages:  # each rank's message names the rank with the bad B
        assert all("1" in m for m in rank_messages), messages


class _Outer:
    """A post-grad pass chained in front of another, as a user or a library would chain one."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, graph):
        if self.previous is not None:
            self.previous(graph)


@pytest.mark.unit
def test_disable_takes_the_pass_out_of_a_chain_another_pass_joined_later():
    import torch._inductor.config as inductor_config

    import torch_gemm_ar

    def inner(graph):
        pass

    with inductor_config.patch(post_grad_custom_post_pass=inner):
        torch_gemm_ar.async_tp.enable()
        outer = _Outer(inductor_config.post_grad_custom_post_pass)
        inductor_config.post_grad_custom_post_pass = outer
        assert torch_gemm_ar.async_tp.is_enabled()
        torch_gemm_ar.async_tp.disable()
        assert not torch_gemm_ar.async_tp.is_enabled()
        assert inductor_config.post_grad_custom_post_pass is outer and outer.previous is inner


@pytest.mark.unit
@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="the NCCL gate only opens where torch has no NCCL")
def test_the_nccl_answer_is_true_only_for_the_compiling_thread(monkeypatch):
    """While torch's micro-pipeline pass runs, it (and only its thread) is told NCCL is available."""
    import threading

    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.micro_pipeline_tp as mptp

    import torch_gemm_ar

    seen = {}

    def fake_pass(graph):
        seen["pass thread"] = torch.distributed.is_nccl_available()
        other = threading.Thread(target=lambda: seen.__setitem__("other thread", torch.distributed.is_nccl_available()))
        other.start()
        other.join()

    monkeypatch.setattr(mptp, "micro_pipeline_tp_pass", fake_pass)
    with inductor_config.patch(_micro_pipeline_tp=True):
        torch_gemm_ar.async_tp.MicroPipelineTPWithoutNccl()(torch.fx.Graph())
    assert seen == {"pass thread": True, "other thread": False}
    assert not torch.distributed.is_nccl_available()
