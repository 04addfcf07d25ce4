// The algorithm names of the op's `algorithm=` argument (docs/decisions/0002-algorithms-and-measured-auto.md).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace gemm_ar {

// FusedTiles and FusedFewProducts are `auto`'s own candidates, never an `algorithm=` value: fused with one tile
// family forced on the CPU engine (CallArgs::fused_family, cpu/call_geometry.h), where the geometry rules picked
// the other one from measurements on one CPU; the tuner measures both on this one. FusedGatheredInputs, also
// `auto`'s own: the CPU engine's flow for outputs much larger than the inputs (cpu/gathered_inputs.h), where every
// owner multiplies its rows by all ranks' inputs instead of reducing their partial products.
enum class Algorithm : int64_t {
  Auto = 0,
  Sequential = 1,
  Chunked = 2,
  Fused = 3,
  FusedTiles = 4,
  FusedFewProducts = 5,
  FusedGatheredInputs = 6
};

// The `algorithm=` names (auto, sequential, chunked, fused).
std::optional<Algorithm> parse_algorithm(std::string_view name);
// Those and the tuner's own candidates (the tune cache, test hooks).
std::optional<Algorithm> parse_tuned_algorithm(std::string_view name);
// Fused, with or without a forced tile family.
bool is_fused(Algorithm algorithm);
// Which tile family a fused algorithm forces (0: none, the geometry rules; 1: tiles; 2: few products; 3: the
// gathered-inputs flow).
int64_t fused_family_of(Algorithm algorithm);
const char* algorithm_name(Algorithm algorithm);
// "auto, sequential, chunked, fused": for error messages.
const char* algorithm_choices();

}  // namespace gemm_ar
