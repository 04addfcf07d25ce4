// The auto tuner's decisions on disk (README, "auto"): a JSON object per host fingerprint, each mapping a bucket's
// key to the algorithm decided for it. Written whole and renamed into place; read in any JSON layout.
#pragma once
#include <map>
#include <string>

namespace gemm_ar {

using TuneCacheFile = std::map<std::string, std::map<std::string, std::string>>;  // fingerprint -> bucket -> algorithm

// `s` as it may be written into the file: no quotes, backslashes or control characters (the writer does not escape).
std::string tune_cache_text(std::string s);
// This machine and build: decisions are kept per fingerprint.
std::string host_fingerprint();
// Adds the file's entries to `file` (a missing or unreadable file adds none; entries that name no algorithm are
// skipped).
void load_tune_cache(const std::string& path, TuneCacheFile& file);
// Writes this process's decisions (`file`) into the cache: re-reads it first, so that decisions other processes
// added since `file` was loaded stay, drops this host's sections of other builds (`fingerprint` is this build's),
// keeps at most `max_per_section` entries per section, replaces the file whole (an unwritable cache only costs
// re-tuning in the next process) and leaves in `file` what it wrote.
void update_tune_cache(const std::string& path, TuneCacheFile& file, const std::string& fingerprint,
                       size_t max_per_section);

}  // namespace gemm_ar
