#include "common/tune_cache_file.h"

#include <torch/version.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/algorithm.h"

#ifndef TORCH_GEMM_AR_VERSION
#define TORCH_GEMM_AR_VERSION "unknown"
#endif

namespace gemm_ar {
namespace {

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown cpu";
}

// The line after `"key": ` up to the closing quote, or "" when the line does not have that form.
bool parse_entry(const std::string& line, std::string* key, std::string* value) {
  const auto k0 = line.find('"');
  const auto k1 = k0 == std::string::npos ? k0 : line.find('"', k0 + 1);
  if (k1 == std::string::npos) return false;
  *key = line.substr(k0 + 1, k1 - k0 - 1);
  const auto colon = line.find(':', k1);
  if (colon == std::string::npos) return false;
  const auto v0 = line.find('"', colon);
  if (v0 == std::string::npos) {
    value->clear();  // an object opens: `"fingerprint": {`
    return line.find('{', colon) != std::string::npos;
  }
  const auto v1 = line.find('"', v0 + 1);
  if (v1 == std::string::npos) return false;
  *value = line.substr(v0 + 1, v1 - v0 - 1);
  return true;
}

}  // namespace

std::string tune_cache_text(std::string s) {
  for (char& c : s) {
    if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) c = '_';
  }
  return s;
}

#ifndef TORCH_GEMM_AR_SOURCE_HASH
#define TORCH_GEMM_AR_SOURCE_HASH "unknown"
#endif

// Decisions are valid for one machine and one build: the CPU, its core count, this library (its version and its
// sources' hash: a rebuilt engine may rank the candidates differently) and torch.
std::string host_fingerprint() {
  std::ostringstream os;
  os << cpu_model() << " | " << std::thread::hardware_concurrency() << " cores | torch_gemm_ar "
     << TORCH_GEMM_AR_VERSION << " (sources " << TORCH_GEMM_AR_SOURCE_HASH << ") | torch " << TORCH_VERSION;
  return tune_cache_text(os.str());
}

void load_tune_cache(const std::string& path, TuneCacheFile& file) {
  std::ifstream in(path);
  std::string line, key, value, section;
  while (std::getline(in, line)) {
    if (!parse_entry(line, &key, &value)) continue;
    if (value.empty()) {
      section = key;
    } else if (!section.empty() && parse_algorithm(value).has_value()) {
      file[section][key] = value;
    }
  }
}

// Written whole to a private temporary file, then renamed over the cache: readers never see half a file, and
// ranks of one host writing at once leave one complete version (they hold the same decisions).
void save_tune_cache(const std::string& path, const TuneCacheFile& file) {
  std::error_code ignored;  // an unwritable cache only costs re-tuning in the next process
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ignored);
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(tmp);
    if (!out) return;
    out << "{\n";
    size_t s = 0;
    for (const auto& [fingerprint, entries] : file) {
      out << " \"" << fingerprint << "\": {\n";
      size_t e = 0;
      for (const auto& [key, algorithm] : entries) {
        out << "  \"" << key << "\": \"" << algorithm << "\"" << (++e < entries.size() ? "," : "") << "\n";
      }
      out << " }" << (++s < file.size() ? "," : "") << "\n";
    }
    out << "}\n";
  }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace gemm_ar
