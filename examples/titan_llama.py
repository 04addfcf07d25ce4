"""A tiny torchtitan (0.3.0) Llama3 tensor-parallelized by torchtitan itself, on CPU gloo ranks: its own model
classes, init and sharding configs (`set_llama3_sharding_config`), `Module.parallelize` on a TP-only
`ParallelDims`, both SPMD backends. For examples/titan_llama_tp.py and tests/test_torchtitan.py.

CPU-only workarounds, each because torchtitan assumes a GPU there:
- torchtitan imports triton at module load for its GPU kernels (expert-parallel dispatch, fused SwiGLU/MLA), which
  CPU runs never call; torch's CPU wheel has no triton. A placeholder module stands in while torchtitan is imported
  and is taken out afterwards; torch's own triton probes run before it is put in, so they see the real absence.
- its device type falls back to "cuda" without a GPU, and `ParallelDims.build_mesh` passes it to
  `init_device_mesh`: set to "cpu" in its module.
- its Llama3 layers take flex attention (compiled by Inductor at the first call: slow on CPU) or varlen attention
  (CUDA); torchtitan's own `ScaledDotProductAttention` inner attention is put in their config instead.
"""
import contextlib
import sys
import types
from typing import Optional

import torch

_titan = None


class _Placeholder:
    """Any attribute, call or decorator of the triton placeholder: itself (a decorator returns the function)."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self


def _module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()


def import_torchtitan():
    """torchtitan's modules this file uses (see the module docstring for the placeholder triton)."""
    global _titan
    if _titan is not None:
        return _titan
    try:
        import triton  # noqa: F401
        placeholder = False
    except ImportError:
        placeholder = True
        # torch's triton probes (cached, or at import of these modules) must see the real absence first.
        import torch._dynamo  # noqa: F401
        import torch._functorch.partitioners  # noqa: F401
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        import torch.utils._triton as torch_triton

        torch_triton.has_triton_package()
        torch_triton.has_triton()
        for name in ("triton", "triton.language"):
            module = types.ModuleType(name)
            module.__getattr__ = _module_getattr
            sys.modules[name] = module
    try:
        import torchtitan.distributed.parallel_dims as parallel_dims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    finally:
        if placeholder:
            for name in ("triton", "triton.language"):
                sys.modules.pop(name, None)
    parallel_dims.device_type = "cpu"
    _titan = types.SimpleNamespace(
        ParallelDims=parallel_dims.ParallelDims, dist_utils=dist_utils, ComplexRoPE=ComplexRoPE, Embedding=Embedding,
        Linear=Linear, RMSNorm=RMSNorm, ScaledDotProductAttention=ScaledDotProductAttention, Llama3Model=Llama3Model,
        build_layers=_build_llama3_layers, set_llama3_sharding_config=set_llama3_sharding_config)
    return _titan


def sizes(world: int) -> dict:
    """Odd per-rank sizes: head_dim 12, 2 heads and 1 KV head per rank, FFN 44 per rank, vocab 31 per rank."""
    return dict(dim=24 * world, heads=2 * world, kv_heads=world, hidden=44 * world, vocab=31 * world)


_dims = {}


def parallel_dims(backend: str, world: int):
    """One TP-only ParallelDims per backend and world (its meshes are process groups: built once per process)."""
    titan = import_torchtitan()
    titan.dist_utils.set_spmd_backend(backend)
    key = (backend, world)
    if key not in _dims:
        dims = titan.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world,
                                  spmd_backend=backend)
        dims.build_mesh()
        _dims[key] = dims
    return _dims[key]


def build(backend: str, sequence_parallel: bool, world: int, seed: int = 0, layers: int = 2, fuse_qkv: bool = False,
          shape: Optional[dict] = None):
    """torchtitan's Llama3 built from its configs, initialized by its init_states (same seed: same weights), and
    parallelized by Module.parallelize; returns (model, context): call the model inside `context()`. fuse_qkv: one
    wqkv projection (torchtitan's FusedQKVLinear) instead of wq/wk/wv. shape: dim, heads, kv_heads, hidden, vocab
    (default: `sizes(world)`)."""
    titan = import_torchtitan()
    s = shape or sizes(world)
    dim = s["dim"]
    config = titan.Llama3Model.Config(
        dim=dim, vocab_size=s["vocab"],
        tok_embeddings=titan.Embedding.Config(num_embeddings=s["vocab"], embedding_dim=dim,
                                              param_init={"weight": torch.nn.init.normal_}),
        norm=titan.RMSNorm.Config(normalized_shape=dim, param_init={"weight": _uniform_norm}),
        lm_head=titan.Linear.Config(in_features=dim, out_features=s["vocab"],
                                    param_init={"weight": lambda p: torch.nn.init.normal_(p, std=dim ** -0.5)}),
        layers=titan.build_layers(n_layers=layers, dim=dim, n_heads=s["heads"], n_kv_heads=s["kv_heads"],
                                  hidden_dim=s["hidden"], fuse_qkv=fuse_qkv, attn_backend="flex",
                                  rope=titan.ComplexRoPE.Config(dim=dim // s["heads"], max_seq_len=512, theta=1e4)))
    for layer in config.layers:
        layer.attention.inner_attention = titan.ScaledDotProductAttention.Config()  # CPU: see the docstring
        layer.attention_norm.param_init = layer.ffn_norm.param_init = {"weight": _uniform_norm}
    titan.set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    dims = parallel_dims(backend, world)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states(buffer_device=None)
    model.parallelize(dims)
    return model, titan.dist_utils.get_spmd_context(parallel_dims=dims)


def _uniform_norm(weight):
    """Norm weights away from 1, so that they matter."""
    torch.nn.init.uniform_(weight, 0.5, 1.5)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a model output or gradient (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


@contextlib.contextmanager
def backend(name: str):
    """torchtitan's process-wide SPMD backend set to `name` for the block (its runtime helpers read it)."""
    titan = import_torchtitan()
    before = titan.dist_utils.get_spmd_backend()
    titan.dist_utils.set_spmd_backend(name)
    try:
        yield
    finally:
        titan.dist_utils.set_spmd_backend(before)
