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
  if (name == "fused/gathered-inputs") return Algorithm::FusedGatheredInputs;
  return parse_algorithm(name);
}

bool is_fused(Algorithm algorithm) {
  return algorithm == Algorithm::Fused || algorithm == Algorithm::FusedTiles ||
         algorithm == Algorithm::FusedFewProducts || algorithm == Algorithm::FusedGatheredInputs;
}

int64_t fused_family_of(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::FusedTiles: return 1;
    case Algorithm::FusedFewProducts: return 2;
    case Algorithm::FusedGatheredInputs: return 3;
    default: return 0;
  }
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::Auto: return "auto";
    case Algorithm::Sequential: return "sequential";
    case Algorithm::Chunked: return "chunked";
    case Algorithm::Fused: return "fused";
    case Algorithm::FusedTiles: return "fused/tiles";
    case Algorithm::FusedFewProducts: return "fused/few-products";
    case Algorithm::FusedGatheredInputs: return "fused/gathered-inputs";
  }
  return "?";
}

const char* algorithm_choices() { return "auto, sequential, chunked, fused"; }

}  // namespace gemm_ar
