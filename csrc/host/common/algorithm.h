// The algorithm names of the op's `algorithm=` argument (design.md §4).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace gemm_ar {

enum class Algorithm : int64_t { Auto = 0, Sequential = 1, Chunked = 2, Fused = 3 };

std::optional<Algorithm> parse_algorithm(std::string_view name);
const char* algorithm_name(Algorithm algorithm);
// "auto, sequential, chunked, fused": for error messages.
const char* algorithm_choices();

}  // namespace gemm_ar
