"""The op table (csrc/host/op_table.h, through _C._op_table()): every op of the family is registered from it with
its schema, and has its fake kernel (torch.compile), its Python wrapper and its CPU kernel."""
import torch
from torch._library.simple_registry import singleton

import torch_gemm_ar
from torch_gemm_ar import _C


def test_every_op_is_registered_with_the_tables_schema():
    table = _C._op_table()
    assert [op["name"] for op in table] == ["gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm",
                                            "gemm_allreduce_add_rmsnorm", "gemm_allreduce_add_rmsnorm_"]
    for op in table:
        schema = getattr(torch.ops.pto, op["name"]).default._schema
        assert str(schema) == str(torch._C.parse_schema("pto::" + op["schema"])), (op, str(schema))


def test_kinds_are_the_signature_codes():
    kinds = {op["name"]: op["kind"] for op in _C._op_table()}
    # gemm_ar/op_kind.hpp: the in-place op runs as its out-of-place form.
    assert kinds == {"gemm_allreduce": 0, "gemm_reduce_scatter": 1, "allgather_gemm": 2,
                     "gemm_allreduce_add_rmsnorm": 3, "gemm_allreduce_add_rmsnorm_": 3}


def test_every_op_has_its_fake_wrapper_and_cpu_kernel():
    for op in _C._op_table():
        name = op["name"]
        assert singleton.find(f"pto::{name}").fake_impl.kernel is not None, f"{name}: no fake kernel"
        assert callable(getattr(torch_gemm_ar, name)), f"{name}: no wrapper in torch_gemm_ar"
        assert name in torch_gemm_ar.__all__, name
        has_cpu = torch._C._dispatch_has_kernel_for_dispatch_key(f"pto::{name}", "CPU")
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(f"pto::{name}", "CompositeExplicitAutograd")
        assert has_cpu or composite, f"{name}: no CPU kernel"


def test_every_op_has_an_autograd_kernel():
    """A formula where the table says differentiable, else the fallback that makes backward raise."""
    for op in _C._op_table():
        name = op["name"]
        autograd = torch._C._dispatch_has_kernel_for_dispatch_key(f"pto::{name}", "Autograd")
        assert autograd, f"{name}: no Autograd kernel (a formula, or the fallback that raises)"
