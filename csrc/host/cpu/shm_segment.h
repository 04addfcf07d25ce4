// One POSIX shared-memory segment mapped into this process (mode 0600). The name is unlinked as soon as every
// rank has mapped it, so nothing stays in /dev/shm; the mapping lives until this object is destroyed.
#pragma once
#include <cstddef>
#include <string>

namespace gemm_ar::cpu {

class SharedSegment {
 public:
  SharedSegment() = default;
  ~SharedSegment();
  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // Creates a new zero-filled segment under a fresh random name (never reused, so two jobs on one host cannot
  // collide) and maps it.
  static SharedSegment create(size_t bytes, const std::string& name_hint);
  // Maps a peer's segment by name; checks its size.
  static SharedSegment open(const std::string& name, size_t bytes);
  // Removes a name from /dev/shm; missing names are fine (someone else already removed it).
  static void unlink_name(const std::string& name);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  SharedSegment(void* data, size_t size, std::string name) : data_(data), size_(size), name_(std::move(name)) {}
  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
};

}  // namespace gemm_ar::cpu
