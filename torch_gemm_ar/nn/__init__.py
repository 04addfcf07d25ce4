"""Drop-in tensor-parallel layers built on gemm_allreduce.

- RowParallelLinear: the row-parallel linear layer (Megatron-LM / vLLM conventions), GEMM and AllReduce fused
  (GEMM and ReduceScatter with sequence_parallel=True).
- ColumnParallelLinear: the column-parallel layer with sequence parallelism, AllGather and GEMM fused.
- replace_row_parallel(model, group=, patterns=): converts an existing model's row-parallel layers in place, both
  DTensor ones (torch.distributed.tensor.parallel.RowwiseParallel, or transformers' tp_plan "rowwise" styles) and
  plain ones selected by name; returns a ReplaceReport (names replaced, and what was skipped and why).
- DTensorRowParallelLinear: what a RowwiseParallel nn.Linear becomes (same parameters, inputs and outputs).
"""
from .column_parallel_linear import ColumnParallelLinear
from .dtensor_row_parallel import DTensorRowParallelLinear
from .replace import ReplaceReport, replace_row_parallel
from .row_parallel_linear import RowParallelLinear

__all__ = ["ColumnParallelLinear", "DTensorRowParallelLinear", "ReplaceReport", "RowParallelLinear",
           "replace_row_parallel"]
