// `sequential` and `chunked` (docs/decisions/0002-algorithms-and-measured-auto.md): any ProcessGroup (gloo, HCCL,
// NCCL), any number of hosts.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "common/call_args.h"

namespace gemm_ar {

// matmul, then one all_reduce of the whole output.
at::Tensor run_sequential(const CallArgs& call, c10d::ProcessGroup& group);

// The [M, N] local product of `sequential`, the bias added on rank 0 only (the sum adds it once).
at::Tensor sequential_partial(const CallArgs& call, int rank);
// How many sequential partial products this process has computed (tests: a call computes its product once).
int64_t sequential_partial_calls();

// Sets call.payload to `payload` holding this rank's fp32 partial product when the call's result can ride on the
// CPU agreement exchange (common/rank_agreement.h). Decided only from fields every rank's signature carries
// (algorithm, M, N, dtype, tuning step) plus the device, so agreeing ranks all carry one or none.
void carry_result_on_agreement(CallArgs& call, Algorithm chosen, int rank, AgreementPayload& payload);

// M split into `chunks` row blocks: block i is multiplied while block i-1's async all_reduce is in flight.
at::Tensor run_chunked(const CallArgs& call, c10d::ProcessGroup& group, int64_t chunks);

// world size 1: the plain product.
at::Tensor run_local(const CallArgs& call);

}  // namespace gemm_ar
