#include "common/algorithm.h"

namespace gemm_ar {

std::optional<Algorithm> parse_algorithm(std::string_view name) {
  if (name == "auto") return Algorithm::Auto;
  if (name == "sequential") return Algorithm::Sequential;
  if (name == "chunked") return Algorithm::Chunked;
  if (name == "fused") return Algorithm::Fused;
  return std::nullopt;
}

std::optional<Algorithm> parse_tuned_algorithm(std::string_view name) {
  if (name == "fused/tiles") return Algorithm::FusedTiles;
  if (name == "fused/few-products") return Algorithm::FusedFewProducts;
  return parse_algorithm(name);
}

bool is_fused(Algorithm algorithm) {
  return algorithm == Algorithm::Fused || algorithm == Algorithm::FusedTiles || algorithm == Algorithm::FusedFewProducts;
}

int64_t fused_family_of(Algorithm algorithm) {
  return algorithm == Algorithm::FusedTiles ? 1 : algorithm == Algorithm::FusedFewProducts ? 2 : 0;
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::Auto: return "auto";
    case Algorithm::Sequential: return "sequential";
    case Algorithm::Chunked: return "chunked";
    case Algorithm::Fused: return "fused";
    case Algorithm::FusedTiles: return "fused/tiles";
    case Algorithm::FusedFewProducts: return "fused/few-products";
  }
  return "?";
}

const char* algorithm_choices() { return "auto, sequential, chunked, fused"; }

}  // namespace gemm_ar
