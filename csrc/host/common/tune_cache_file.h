// The auto tuner's decisions on disk (docs/usage.md, "`auto` by measurement"): a JSON object per host fingerprint, each
// mapping a bucket's key to the algorithm decided for it. Written whole and renamed into place; read in any JSON
// layout.
#pragma once
#include <cstddef>
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
// A section's entry that says when it was last written (seconds since the epoch), not a bucket.
constexpr const char* kTuneCacheWrittenKey = "written at";
// How many builds of the library on one host keep their sections (their fingerprints differ by the sources' hash).
constexpr size_t kTuneCacheBuildsPerHost = 4;

// Writes this process's decisions (`file`, the section `fingerprint` just got `decided`) into the cache, one process
// at a time (a lock file beside it): re-reads it first, so that decisions other processes wrote stay; keeps this
// host's sections of the kTuneCacheBuildsPerHost builds that wrote last, every other host's, and at most
// `max_per_section` buckets per section (never `decided`); replaces the file whole (an unwritable cache only costs
// re-tuning in the next process) and leaves in `file` what it wrote.
void update_tune_cache(const std::string& path, TuneCacheFile& file, const std::string& fingerprint,
                       const std::string& decided, size_t max_per_section);

}  // namespace gemm_ar
