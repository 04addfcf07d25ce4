// The auto tuner's decisions on disk (README, "auto"): a JSON object per host fingerprint, each mapping a bucket's
// key to the algorithm decided for it. Written whole and renamed into place, read line by line.
#pragma once
#include <map>
#include <string>

namespace gemm_ar {

using TuneCacheFile = std::map<std::string, std::map<std::string, std::string>>;  // fingerprint -> bucket -> algorithm

// `s` as it may be written into the file: no quotes, backslashes or control characters (the reader is line-based).
std::string tune_cache_text(std::string s);
// This machine and build: decisions are kept per fingerprint.
std::string host_fingerprint();
// Adds the file's entries to `file` (a missing or unreadable file adds none; entries that name no algorithm are
// skipped).
void load_tune_cache(const std::string& path, TuneCacheFile& file);
// Replaces the file by `file` (an unwritable cache only costs re-tuning in the next process).
void save_tune_cache(const std::string& path, const TuneCacheFile& file);

}  // namespace gemm_ar
