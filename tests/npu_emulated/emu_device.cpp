// The emulated NPU as torch's PrivateUse1 device (docs/decisions/0019-emulated-npu-runtime.md): its allocator, its
// device guard (one device, the emulated streams), the hooks torch asks a PrivateUse1 backend for, and the ATen
// kernels the host code and the tests use. Operations outside the seam (ATen on "npu" tensors) run on the host once
// the current stream has drained: the order a device gives them on the current stream, with a host wait added.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "emu_memory.h"
#include "emu_streams.h"

namespace gemm_ar::emu {
namespace {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;

c10::Device the_device() { return c10::Device(kNpu, 0); }

struct EmulatedGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device) const override { return the_device(); }
  c10::Device getDevice() const override { return the_device(); }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.index() <= 0, "the emulated NPU runtime has one device (npu:0), not ", device.str());
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::UNSAFE, the_device(), current_stream_id());
  }
  c10::Stream getDefaultStream(c10::Device) const override { return c10::Stream(c10::Stream::UNSAFE, the_device(), 0); }
  c10::Stream getNewStream(c10::Device, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, the_device(), new_stream().id());
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    const c10::Stream previous(c10::Stream::UNSAFE, the_device(), current_stream_id());
    try {
      set_current_stream_id(s.id());
    } catch (...) {
    }
    return previous;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream& s) const override { return stream(s.id()).idle(); }
  void synchronizeStream(const c10::Stream& s) const override { synchronize(stream(s.id())); }
  void synchronizeDevice(const c10::DeviceIndex) const override { synchronize_all(); }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, EmulatedGuard);

struct EmulatedHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  at::Device getDeviceFromPtr(void*) const override { return the_device(); }
  bool isPinnedPtr(const void*) const override { return false; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    at::native::resize_bytes_nocuda(storage, bytes);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new EmulatedHooks());
  return true;
}();

// ATen work on "npu" tensors outside the seam runs in order with the current stream.
void drain_current_stream() { synchronize(stream(current_stream_id())); }

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "the emulated NPU has strided tensors only");
  return at::detail::empty_generic(size, &device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "the emulated NPU has strided tensors only");
  return at::detail::empty_strided_generic(size, stride, &device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::cpu::as_strided(self, size, stride, storage_offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, /*stride=*/std::nullopt);
  if (memory_format.has_value() && *memory_format != c10::MemoryFormat::Preserve) {
    self.unsafeGetTensorImpl()->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  drain_current_stream();
  if (dst.numel() > 0) cpu_alias(dst).copy_(cpu_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  drain_current_stream();
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  if (dst.numel() > 0) cpu_alias(dst).copy_(cpu_alias(self));
  return dst;
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  drain_current_stream();
  return cpu_alias(self).item();
}

// Everything else: on CPU copies of the operands, written back (at::native::cpu_fallback), after the current
// stream drained.
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  drain_current_stream();
  at::native::cpu_fallback(op, stack);
}

}  // namespace
}  // namespace gemm_ar::emu

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &gemm_ar::emu::empty_memory_format);
  m.impl("empty_strided", &gemm_ar::emu::empty_strided);
  m.impl("as_strided", &gemm_ar::emu::as_strided);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
  m.impl("resize_", &gemm_ar::emu::resize_);
  m.impl("_copy_from", &gemm_ar::emu::copy_from);
  m.impl("_copy_from_and_resize", &gemm_ar::emu::copy_from_and_resize);
  m.impl("_local_scalar_dense", &gemm_ar::emu::local_scalar_dense);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&gemm_ar::emu::fallback>());
}
