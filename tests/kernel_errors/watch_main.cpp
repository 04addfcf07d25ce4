// Drives csrc/host/common/kernel_error_watch.cpp and kernel_timeout.h with fake records, without torch or an NPU
// (tests/test_kernel_error_watch.py). Reads commands from stdin, one per line, prints one line per command:
//   first <epoch>                     a new watch whose first call gets <epoch>            -> "ok"
//   call                              the next call is queued (take_epoch)                 -> its epoch
//   record <call> <code> <rank> <peer> <item>   a record tagged for call #<call> (0: tag 0, never written)
//                                     -> the message take_unreported() returns, or "-"
//   bound <requested_ms> <aicore_ms>  kernel_wait_bound()                                  -> "<wait_ms> <capped>"
#include <cstdint>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>

#include "common/kernel_error_watch.h"
#include "common/kernel_timeout.h"

namespace {

const char* field_name(int64_t word) {
  static const char* const names[] = {"error", "M", "K", "N", "dtype"};
  return word >= 0 && word < 5 ? names[word] : nullptr;
}

const char* code_summary(int64_t code) { return code == 8 ? "algorithm='fused' is not available there" : nullptr; }

}  // namespace

int main() {
  gemm_ar::KernelErrorWatch watch;
  uint32_t first = 0;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    if (command == "first") {
      in >> first;
      watch = gemm_ar::KernelErrorWatch(first);
      std::cout << "ok\n";
    } else if (command == "call") {
      std::cout << watch.take_epoch() << "\n";
    } else if (command == "record") {
      uint32_t call = 0;
      gemm_ar::ErrorRecord record;
      std::memset(&record, 0, sizeof(record));
      in >> call >> record.code >> record.rank >> record.peer >> record.item;
      record.tag = call == 0 ? 0 : gemm_ar::signal_tag(first + call - 1);
      const std::string message = watch.take_unreported(record, "tp", &field_name, &code_summary);
      std::cout << (message.empty() ? "-" : message) << "\n";
    } else if (command == "bound") {
      int64_t requested = 0, aicore = 0;
      in >> requested >> aicore;
      const gemm_ar::KernelWaitBound bound = gemm_ar::kernel_wait_bound(requested, aicore);
      std::cout << bound.wait_ms << " " << (bound.capped ? 1 : 0) << "\n";
    } else {
      std::cerr << "unknown command: " << line << "\n";
      return 2;
    }
  }
  return 0;
}
