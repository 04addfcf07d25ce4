#include "common/algorithm.h"

namespace gemm_ar {

std::optional<Algorithm> parse_algorithm(std::string_view name) {
  if (name == "auto") return Algorithm::Auto;
  if (name == "sequential") return Algorithm::Sequential;
  if (name == "chunked") return Algorithm::Chunked;
  if (name == "fused") return Algorithm::Fused;
  return std::nullopt;
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::Auto: return "auto";
    case Algorithm::Sequential: return "sequential";
    case Algorithm::Chunked: return "chunked";
    case Algorithm::Fused: return "fused";
  }
  return "?";
}

const char* algorithm_choices() { return "auto, sequential, chunked, fused"; }

}  // namespace gemm_ar
