"""The op table (csrc/host/op_table.h, through _C._op_table()): every op of the family is registered from it, and
has a fake kernel written with the schema's parameters, its Python wrapper, its CPU kernel and an Autograd kernel."""
import inspect

import torch
from torch._library.simple_registry import singleton

import torch_gemm_ar
from torch_gemm_ar import _C, _registrations

NAMES = ["gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm", "gemm_allreduce_add_rmsnorm",
         "gemm_allreduce_add_rmsnorm_"]
# The fakes of torch_gemm_ar/_registrations.py, written by hand from the schemas.
FAKES = {"gemm_allreduce": "_gemm_allreduce_fake", "gemm_reduce_scatter": "_gemm_reduce_scatter_fake",
         "allgather_gemm": "_allgather_gemm_fake", "gemm_allreduce_add_rmsnorm": "_gemm_allreduce_add_rmsnorm_fake",
         "gemm_allreduce_add_rmsnorm_": "_gemm_allreduce_add_rmsnorm_inplace_fake"}


def test_every_op_of_the_table_is_registered():
    assert [op["name"] for op in _C._op_table()] == NAMES
    for op in _C._op_table():
        assert getattr(torch.ops.pto, op["name"]).default._schema.name == "pto::" + op["name"]


def test_kinds_are_the_signature_codes():
    kinds = {op["name"]: op["kind"] for op in _C._op_table()}
    # gemm_ar/op_kind.hpp: the in-place op runs as its out-of-place form.
    assert kinds == {"gemm_allreduce": 0, "gemm_reduce_scatter": 1, "allgather_gemm": 2,
                     "gemm_allreduce_add_rmsnorm": 3, "gemm_allreduce_add_rmsnorm_": 3}


def test_each_fake_takes_the_schemas_parameters():
    """The C++ schema and the Python fake are written separately: their parameters, their order, which are
    keyword-only and their defaults must agree, or torch.compile traces something the op does not take."""
    for op in _C._op_table():
        schema = getattr(torch.ops.pto, op["name"]).default._schema
        fake = inspect.signature(getattr(_registrations, FAKES[op["name"]]))
        params = list(fake.parameters.values())
        assert [p.name for p in params] == [a.name for a in schema.arguments], op["name"]
        for p, a in zip(params, schema.arguments):
            assert (p.kind == inspect.Parameter.KEYWORD_ONLY) == a.kwarg_only, (op["name"], a.name)
            if a.has_default_value():
                assert p.default == a.default_value, (op["name"], a.name, p.default, a.default_value)
            else:
                assert p.default is inspect.Parameter.empty, (op["name"], a.name)
        assert singleton.find(f"pto::{op['name']}").fake_impl.kernel is not None, op["name"]


def test_every_op_has_its_wrapper_and_kernels():
    for name in NAMES:
        assert callable(getattr(torch_gemm_ar, name)) and name in torch_gemm_ar.__all__, name
        qualified = f"pto::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Autograd"), f"{name}: no Autograd kernel"
        if name == "gemm_allreduce_add_rmsnorm_":  # a composite of the out-of-place op on every device
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd")
        else:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"), f"{name}: no CPU kernel"
