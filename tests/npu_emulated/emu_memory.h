// Memory of the emulated NPU: host memory, handed out for the current stream and given back in stream order as the
// caching allocator does (docs/decisions/0019-emulated-npu-runtime.md): a freed block is poisoned (0xFF bytes, the
// NaN pattern) and released only once its allocation stream, and every stream keep_alive named, has reached the
// point where it was freed. Memory used after that point by work the host did not keep it alive for reads NaN.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>

namespace gemm_ar::emu {

c10::Allocator& device_allocator();

// The block of `tensor` stays allocated until `stream_id` has run everything queued on it so far.
void keep_alive(int64_t stream_id, const at::Tensor& tensor);

// A CPU tensor over the same memory, sizes and strides (a CPU tensor is returned as it is).
at::Tensor cpu_alias(const at::Tensor& tensor);

}  // namespace gemm_ar::emu
