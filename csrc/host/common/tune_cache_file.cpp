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

// The JSON string that starts at text[i] (a quote), its escapes undone; `i` ends past its closing quote.
bool read_string(const std::string& text, size_t& i, std::string* out) {
  out->clear();
  for (++i; i < text.size(); ++i) {
    if (text[i] == '\\') {
      if (++i < text.size()) out->push_back(text[i]);
    } else if (text[i] == '"') {
      ++i;
      return true;
    } else {
      out->push_back(text[i]);
    }
  }
  return false;
}

// "cpu | cores" of a fingerprint (host_fingerprint's layout), or "" when it has no build part.
std::string host_part(const std::string& fingerprint) {
  const auto build = fingerprint.find(" | torch_gemm_ar ");
  return build == std::string::npos ? std::string() : fingerprint.substr(0, build);
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
  std::stringstream whole;
  whole << in.rdbuf();
  const std::string text = whole.str();
  // The file's shape is {"fingerprint": {"bucket": "algorithm", ...}, ...}, in any layout (a user may have
  // reformatted it). Whatever else it holds is skipped: a damaged cache only costs re-tuning.
  int depth = 0;
  bool have_key = false;
  std::string section, key, value;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"') {
      if (!read_string(text, i, have_key ? &value : &key)) return;
      if (have_key && depth == 2 && !section.empty() && parse_algorithm(value).has_value()) file[section][key] = value;
      have_key = !have_key;
      continue;
    }
    if (c == '{' || c == '[') {
      ++depth;
      if (depth == 2) section = c == '{' && have_key ? key : std::string();
      have_key = false;
    } else if (c == '}' || c == ']') {
      if (depth == 2) section.clear();
      --depth;
      have_key = false;
    } else if (c == ',') {
      have_key = false;
    }
    ++i;
  }
}

namespace {

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

}  // namespace

void update_tune_cache(const std::string& path, TuneCacheFile& file, const std::string& fingerprint,
                       size_t max_per_section) {
  TuneCacheFile merged;
  load_tune_cache(path, merged);
  for (const auto& [section, entries] : file) {
    for (const auto& [key, algorithm] : entries) merged[section][key] = algorithm;
  }
  // Every rebuild has a fingerprint of its own (the sources' hash): without this the file would keep a dead section
  // per rebuild. Another host's sections stay (a home directory may be shared between machines).
  const std::string host = host_part(fingerprint);
  for (auto it = merged.begin(); it != merged.end();) {
    const bool stale = it->first != fingerprint && !host.empty() && host_part(it->first) == host;
    it = stale ? merged.erase(it) : std::next(it);
  }
  for (auto& [section, entries] : merged) {  // over the bound: other processes' entries go first
    const auto own = file.find(section);
    for (auto e = entries.begin(); entries.size() > max_per_section && e != entries.end();) {
      const bool mine = own != file.end() && own->second.count(e->first) != 0;
      e = mine ? std::next(e) : entries.erase(e);
    }
  }
  file = std::move(merged);
  save_tune_cache(path, file);
}

}  // namespace gemm_ar
