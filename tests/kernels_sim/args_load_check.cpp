// Runs the kernels' real load_kernel_args (csrc/kernels/device_support.hpp) the way the kernels call it, built as
// on the device (-DGEMM_AR_PLAIN_SCALARS: plain volatile loads, no cache model) at -O2 with strict aliasing, and
// checks that every field the kernel code then reads by name holds what the host wrote. A struct filled through a
// pointer of another type lets the optimiser keep a field's earlier value (the zeroes of `KernelArgs args{}`):
// exactly what this catches (tests/test_kernels_device_build.py).
//
//   args_load_check   prints one "mismatch <case>/<start> <field> got <hex> want <hex>" line per wrong field
//                     (case: where the epoch comes from; start: zeroed or uninitialised KernelArgs), then
//                     "checked <fields> fields in 2 cases, <mismatches> mismatches"; exit code 1 on a mismatch
#include <pto/pto-inst.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "device_support.hpp"

using gemm_ar::KernelArgs;

// Every field of KernelArgs, by name (signature[] is checked word by word below).
// clang-format off
#define GEMM_AR_KERNEL_ARGS_FIELDS(X)                                                                                  \
  X(magic) X(dtype) X(b_layout) X(epoch) X(a) X(b) X(bias) X(out) X(lda) X(ldb) X(ldo) X(comm_ctx)                     \
  X(window_offset) X(window_bytes) X(scratch) X(error) X(epoch_counter) X(rank) X(world) X(compute_blocks)             \
  X(comm_blocks) X(bias_rank) X(wait_timeout_us) X(signature_only) X(variant) X(plan.m) X(plan.n) X(plan.k)          \
  X(plan.base_m) X(plan.base_n) X(plan.base_k) X(plan.k_step) X(plan.m_tiles) X(plan.n_tiles) X(plan.tiles)            \
  X(plan.pad_m) X(plan.pad_n) X(plan.pad_k) X(plan.sub_m) X(plan.stripes) X(chunks.count) X(chunks.rows)               \
  X(chunks.m_tiles) X(layout.prepared_offset) X(layout.prepared_bytes) X(layout.signature_offset)                      \
  X(layout.signature_bytes) X(layout.reduced_offset) X(layout.reduced_bytes) X(layout.contrib_offset)                  \
  X(layout.contrib_bytes) X(layout.arrival_offset) X(layout.arrival_bytes) X(layout.window_bytes)                      \
  X(layout.partial_offset) X(layout.partial_bytes) X(layout.queue_offset) X(layout.queue_stride)                       \
  X(layout.queue_capacity) X(layout.scratch_bytes) X(epilogue.kind) X(epilogue.eps) X(epilogue.residual)               \
  X(epilogue.norm_weight) X(epilogue.normed) X(epilogue.ld_residual) X(epilogue.ld_normed)
// clang-format on

#define GEMM_AR_FIELD_BYTES(f) +sizeof(KernelArgs{}.f)
#define GEMM_AR_FIELD_ONE(f) +1
constexpr uint64_t kListedBytes = 0 GEMM_AR_KERNEL_ARGS_FIELDS(GEMM_AR_FIELD_BYTES) + sizeof(KernelArgs{}.signature);
static_assert(kListedBytes == sizeof(KernelArgs), "a KernelArgs field is missing from the list above");
constexpr int kNamedFields = 0 GEMM_AR_KERNEL_ARGS_FIELDS(GEMM_AR_FIELD_ONE);
constexpr int kFields = kNamedFields + static_cast<int>(gemm_ar::kSignatureWords);

// A field's bytes, widened to 64 bits for comparing and printing. By value: the field is read as its own type,
// as the kernels read it (a byte copy straight from the struct would be exempt from type-based aliasing).
template <typename F>
uint64_t bits_of(F value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(F));
  return bits;
}

// A value for field number k: nonzero (unlike the zeroed struct) and different from every other field's.
template <typename F>
void fill(F& field, uint64_t k) {
  field = static_cast<F>(sizeof(F) == 8 ? 0x0123456700000000ull + 0x10001ull * k : 0x1010u + 0x101u * k);
}
void fill(float& field, uint64_t k) { field = 0.5f + static_cast<float>(k); }

// What the kernel code sees of each field after loading, read by name as the kernels read them.
struct Seen {
  uint64_t bits[kFields];
};

// Inlined into the kernel starts below, as the kernels' checks of their arguments are.
__attribute__((always_inline)) inline void read_fields(const KernelArgs& args, Seen* seen) {
  int i = 0;
#define GEMM_AR_READ_FIELD(f) seen->bits[i++] = bits_of(args.f);
  GEMM_AR_KERNEL_ARGS_FIELDS(GEMM_AR_READ_FIELD)
  for (int64_t w = 0; w < gemm_ar::kSignatureWords; ++w) seen->bits[i++] = bits_of(args.signature[w]);
}

// As sp_compute_kernel.cpp / sp_comm_kernel.cpp start: a zero-initialised KernelArgs, loaded, then read.
__attribute__((noinline)) void load_zeroed(__gm__ uint8_t* args_gm, Seen* seen) {
  KernelArgs args{};
  gemm_ar::device::load_kernel_args(args_gm, &args);
  read_fields(args, seen);
}

// As gemm_compute_kernel.cpp / gemm_comm_kernel.cpp start: an uninitialised KernelArgs, loaded, then read.
__attribute__((noinline)) void load_uninitialised(__gm__ uint8_t* args_gm, Seen* seen) {
  KernelArgs args;
  gemm_ar::device::load_kernel_args(args_gm, &args);
  read_fields(args, seen);
}

static const char* const kFieldNames[kNamedFields] = {
#define GEMM_AR_FIELD_NAME(f) #f,
    GEMM_AR_KERNEL_ARGS_FIELDS(GEMM_AR_FIELD_NAME)};

// Runs both kernel starts on the host's image of `want` and reports every field that differs; returns the count.
int check_case(const char* name, const KernelArgs& want, uint32_t want_epoch) {
  alignas(64) static uint8_t gm[sizeof(KernelArgs)];  // the device memory the host copied KernelArgs into
  std::memcpy(gm, &want, sizeof(KernelArgs));
  Seen expected{};
  read_fields(want, &expected);
  for (int f = 0; f < kNamedFields; ++f) {
    // load_kernel_args takes the epoch from the device counter when there is one
    if (std::strcmp(kFieldNames[f], "epoch") == 0) expected.bits[f] = want_epoch;
  }
  int mismatches = 0;
  for (int start = 0; start < 2; ++start) {
    Seen seen{};
    if (start == 0) {
      load_zeroed(gm, &seen);
    } else {
      load_uninitialised(gm, &seen);
    }
    for (int f = 0; f < kFields; ++f) {
      if (seen.bits[f] == expected.bits[f]) continue;
      ++mismatches;
      char field[32];
      if (f < kNamedFields) {
        std::snprintf(field, sizeof(field), "%s", kFieldNames[f]);
      } else {
        std::snprintf(field, sizeof(field), "signature[%d]", f - kNamedFields);
      }
      std::printf("mismatch %s/%s %s got %#llx want %#llx\n", name, start == 0 ? "zeroed" : "uninitialised", field,
                  static_cast<unsigned long long>(seen.bits[f]), static_cast<unsigned long long>(expected.bits[f]));
    }
  }
  return mismatches;
}

int main() {
  KernelArgs want{};
  uint64_t k = 1;
#define GEMM_AR_FILL_FIELD(f) fill(want.f, k++);
  GEMM_AR_KERNEL_ARGS_FIELDS(GEMM_AR_FILL_FIELD)
  for (int64_t w = 0; w < gemm_ar::kSignatureWords; ++w) fill(want.signature[w], k++);
  int mismatches = 0;
  // The epoch as the host wrote it into KernelArgs.
  want.epoch_counter = 0;
  mismatches += check_case("epoch_in_args", want, want.epoch);
  // The epoch from the device counter a graph replay advances (KernelArgs::epoch_counter).
  alignas(64) static int64_t counter = 0x0000000a5a5a5a5bll;
  want.epoch_counter = reinterpret_cast<uint64_t>(&counter);
  mismatches += check_case("epoch_from_counter", want, static_cast<uint32_t>(counter));
  std::printf("checked %d fields in 2 cases, %d mismatches\n", kFields, mismatches);
  return mismatches == 0 ? 0 : 1;
}
