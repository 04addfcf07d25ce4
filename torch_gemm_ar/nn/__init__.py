"""Drop-in tensor-parallel layers built on gemm_allreduce.

- RowParallelLinear: the row-parallel linear layer (Megatron-LM / vLLM conventions), GEMM and AllReduce fused
  (GEMM and ReduceScatter with sequence_parallel=True).
- ColumnParallelLinear: the column-parallel layer; with sequence parallelism AllGather and GEMM fused, without it
  the input gradient's AllReduce fused with its GEMM in backward.
- replace_row_parallel(model, group=, patterns=): converts an existing model's row-parallel layers in place, both
  DTensor ones (torch.distributed.tensor.parallel.RowwiseParallel, or transformers' tp_plan "rowwise" styles) and
  plain ones selected by name; returns a ReplaceReport (names replaced, and what was skipped and why).
- replace_column_parallel(model, patterns=, group=): converts a plain model's column-parallel layers (Megatron-LM's,
  gather_output=False) to ColumnParallelLinear(sequence_parallel=False), so training fuses their backward all-reduce.
- replace_sequence_parallel(model): converts a DTensor plan's sequence-parallel layers in place
  (ColwiseParallel(input_layouts=Shard(d)) -> allgather_gemm, RowwiseParallel(output_layouts=Shard(d)) ->
  gemm_reduce_scatter).
- replace_megatron(model): converts Megatron-core's RowParallelLinear / ColumnParallelLinear modules (found by type)
  to MegatronRowParallelLinear / MegatronColumnParallelLinear, which return Megatron's (output, output_bias) pair.
- replace_torchtitan(model): fuses the collectives of a model parallelized by torchtitan's Module.parallelize
  (its sharding configs: row layers -> gemm_allreduce / gemm_reduce_scatter, column layers under attention and
  feed-forward -> allgather_gemm or the backward all-reduce fused).
- DTensorRowParallelLinear: what a RowwiseParallel nn.Linear becomes (same parameters, inputs and outputs).
- DTensorColumnParallelLinear: what a ColwiseParallel(input_layouts=Shard(d)) nn.Linear becomes.
"""
from .column_parallel_linear import ColumnParallelLinear
from .dtensor_column_parallel import DTensorColumnParallelLinear
from .dtensor_row_parallel import DTensorRowParallelLinear
from .replace import ReplaceReport, replace_row_parallel
from .replace_column_parallel import replace_column_parallel
from .replace_megatron import MegatronColumnParallelLinear, MegatronRowParallelLinear, replace_megatron
from .replace_sequence_parallel import replace_sequence_parallel
from .replace_torchtitan import replace_torchtitan
from .row_parallel_linear import RowParallelLinear

__all__ = ["ColumnParallelLinear", "DTensorColumnParallelLinear", "DTensorRowParallelLinear",
           "MegatronColumnParallelLinear", "MegatronRowParallelLinear", "ReplaceReport", "RowParallelLinear",
           "replace_column_parallel", "replace_megatron", "replace_row_parallel", "replace_sequence_parallel",
           "replace_torchtitan"]
