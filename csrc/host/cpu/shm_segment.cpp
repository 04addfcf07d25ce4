#include "cpu/shm_segment.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "common/current_op.h"

namespace gemm_ar::cpu {
namespace {

std::string random_suffix() {
  std::random_device device;
  std::mt19937_64 gen((static_cast<uint64_t>(device()) << 32) ^ device() ^ static_cast<uint64_t>(getpid()));
  char buffer[24];
  std::snprintf(buffer, sizeof(buffer), "%016llx", static_cast<unsigned long long>(gen()));
  return buffer;
}

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  TORCH_CHECK(data != MAP_FAILED, current_op(), ": mmap of shared-memory window ", name, " (", bytes,
              " bytes) failed: ", std::strerror(err));
  return data;
}

}  // namespace

SharedSegment::~SharedSegment() {
  if (data_ != nullptr) munmap(data_, size_);
}

SharedSegment::SharedSegment(SharedSegment&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), name_(std::move(other.name_)) {}

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    name_ = std::move(other.name_);
  }
  return *this;
}

SharedSegment SharedSegment::create(size_t bytes, const std::string& name_hint) {
  std::string name = "/tgar-" + name_hint + "-" + random_suffix();
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, current_op(), ": shm_open(", name, ") failed: ", std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, current_op(), ": cannot size shared-memory window ", name, " to ", bytes,
                " bytes: ", std::strerror(err), " (is /dev/shm large enough?)");
  }
  try {
    return SharedSegment(map_fd(fd, bytes, name), bytes, name);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
}

SharedSegment SharedSegment::open(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, current_op(), ": cannot open a peer's shared-memory window ", name, ": ", std::strerror(errno));
  struct stat info {};
  if (fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) < bytes) {
    close(fd);
    TORCH_CHECK(false, current_op(), ": peer window ", name, " is smaller than the agreed ", bytes, " bytes");
  }
  return SharedSegment(map_fd(fd, bytes, name), bytes, name);
}

void SharedSegment::unlink_name(const std::string& name) { shm_unlink(name.c_str()); }

}  // namespace gemm_ar::cpu
