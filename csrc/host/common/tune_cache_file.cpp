#include "common/tune_cache_file.h"

#include <torch/version.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/file.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

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
      if (have_key && depth == 2 && !section.empty() &&
          (parse_tuned_algorithm(value).has_value() || (key == kTuneCacheWrittenKey && !value.empty() &&
                                                        value.find_first_not_of("0123456789") == std::string::npos))) {
        file[section][key] = value;
      }
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
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);  // hosts sharing a home directory each write their own temporary file
  const std::string tmp = path + ".tmp." + host + "." + std::to_string(getpid());
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
                       const std::string& decided, size_t max_per_section) {
  std::error_code ignored;  // an unwritable cache only costs re-tuning in the next process
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ignored);
  // One writer at a time (flock, released by close or by the process's death): a decision that another process
  // wrote between this one's read and its rename would be lost. Bounded: after 2 s (a writer stopped in a debugger)
  // this one writes anyway, which at worst loses that other process's new entries.
  const int lock = ::open((path + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  for (int tries = 0; lock >= 0 && ::flock(lock, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK && tries < 200;
       ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  TuneCacheFile merged;
  load_tune_cache(path, merged);
  for (const auto& [section, entries] : file) {
    for (const auto& [key, value] : entries) merged[section][key] = value;
  }
  merged[fingerprint][kTuneCacheWrittenKey] = std::to_string(static_cast<long long>(std::time(nullptr)));
  // Every rebuild has a fingerprint of its own (the sources' hash), so this host keeps only the sections its
  // kTuneCacheBuildsPerHost builds written last have written (several environments on one host keep theirs).
  // Another host's sections stay (a home directory may be shared between machines).
  const std::string host = host_part(fingerprint);
  std::vector<std::pair<long long, std::string>> builds;  // (written at, fingerprint) of this host's sections
  for (const auto& [section, entries] : merged) {
    if (host.empty() || host_part(section) != host) continue;
    const auto written = entries.find(kTuneCacheWrittenKey);
    builds.emplace_back(written == entries.end() ? 0 : std::atoll(written->second.c_str()), section);
  }
  std::sort(builds.begin(), builds.end(), [&](const auto& x, const auto& y) {
    return (x.second == fingerprint) != (y.second == fingerprint) ? x.second == fingerprint : x.first > y.first;
  });
  for (size_t i = kTuneCacheBuildsPerHost; i < builds.size(); ++i) merged.erase(builds[i].second);
  for (auto& [section, entries] : merged) {  // over the bound: the entries first in key order go, not this one
    for (auto e = entries.begin(); entries.size() > max_per_section + 1 && e != entries.end();) {
      const bool keep = e->first == kTuneCacheWrittenKey || (section == fingerprint && e->first == decided);
      e = keep ? std::next(e) : entries.erase(e);
    }
  }
  file = std::move(merged);
  save_tune_cache(path, file);
  if (lock >= 0) ::close(lock);
}

}  // namespace gemm_ar
