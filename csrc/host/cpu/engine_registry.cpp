// The process's CPU fused engines, one per process group (FusedEngine::of): created on a group's first call,
// released once the group is destroyed or garbage-collected, and refused in a forked child for groups its parent set
// up.
#include <c10/util/Exception.h>

#include <pthread.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <unistd.h>

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/current_op.h"
#include "common/test_hooks.h"
#include "cpu/fused_call.h"
#include "cpu/fused_engine.h"
#include "cpu/output_pool.h"

namespace gemm_ar::cpu {

namespace {

// One group's place in the registry. The registry lock covers only finding or inserting a slot; the collective
// setup runs under the slot's own mutex, so that groups set up from different threads never wait for each other.
struct EngineSlot {
  explicit EngineSlot(c10d::ProcessGroup& g)
      : group(&g), alive(c10::intrusive_ptr<c10d::ProcessGroup>::unsafe_reclaim_from_nonowning(&g)) {}
  const c10d::ProcessGroup* group;                    // identity only: never dereferenced
  c10::weak_intrusive_ptr<c10d::ProcessGroup> alive;  // expires when the group is garbage-collected
  std::mutex setup_mutex;
  std::shared_ptr<FusedEngine> engine;  // guarded by setup_mutex
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<EngineSlot>> slots;
  // In a forked child: the groups whose engine the parent set up (their windows and threads are the parent's).
  std::map<std::string, const c10d::ProcessGroup*> inherited;
  pid_t parent = 0;
};

Registry* registry = nullptr;  // never destroyed: engines may be in use during static destruction

// Runs in the child right after fork(), while it has a single thread. The parent's registry is left untouched
// (its mutex may have been held by another parent thread at fork time); the child starts a fresh one that only
// remembers which groups it must refuse. (Reading the parent's map unlocked is safe unless another parent thread
// was inserting into it at the very moment of fork.)
void after_fork_in_child() {
  Registry* parent = registry;
  auto* fresh = new Registry();
  fresh->parent = getppid();
  for (const auto& [name, slot] : parent->slots) fresh->inherited[name] = slot->group;
  for (const auto& [name, group] : parent->inherited) fresh->inherited[name] = group;
  registry = fresh;
}

Registry& the_registry() {
  static Registry* once = [] {
    registry = new Registry();
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
    return registry;
  }();
  (void)once;
  return *registry;
}

// A group is gone once garbage-collected, or once its name no longer resolves to it (destroy_process_group
// unregisters it, even while Python still holds a reference).
bool group_is_gone(const std::string& name, const EngineSlot& slot) {
  if (slot.alive.expired()) return true;
  try {
    return c10d::resolve_process_group(name).get() != slot.group;
  } catch (const std::exception&) {
    return true;
  }
}

// Takes out of the registry the slots of groups that are gone (except `keep`). Caller holds reg.mutex; the slots
// are destroyed by the caller after dropping it (that joins comm threads and unmaps windows).
std::vector<std::shared_ptr<EngineSlot>> take_gone_slots(Registry& reg, const c10d::ProcessGroup* keep) {
  std::vector<std::shared_ptr<EngineSlot>> released;
  for (auto it = reg.slots.begin(); it != reg.slots.end();) {
    if (it->second->group != keep && group_is_gone(it->first, *it->second)) {
      released.push_back(std::move(it->second));
      it = reg.slots.erase(it);
    } else {
      ++it;
    }
  }
  return released;
}

void release(std::vector<std::shared_ptr<EngineSlot>>& released) {
  if (released.empty()) return;
  released.clear();  // the last reference to an idle engine: joins its comm threads, unmaps its windows
  trim_output_pool();
}

// Releases the engines of destroyed or collected groups within about a second, without waiting for another call
// (a process may destroy its groups and never call again). One thread per process, stopped at exit before the
// statics it uses (c10d's group registry) are destroyed: std::atexit runs in reverse order of registration.
class GroupReaper {
 public:
  // Also in a forked child that sets up groups of its own (threads are not copied by fork).
  static void start() {
    static std::mutex start_mutex;
    std::lock_guard<std::mutex> lock(start_mutex);
    if (instance_ != nullptr && instance_->owner_ == getpid()) return;
    const bool first = instance_ == nullptr;
    instance_ = new GroupReaper();  // never freed: it outlives every engine; a child's copy of the parent's leaks
    instance_->thread_ = std::thread([r = instance_] { r->loop(); });
    if (first) std::atexit([] { instance_->stop(); });  // atexit handlers are inherited across fork
  }

 private:
  static inline GroupReaper* instance_ = nullptr;

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      wake_.wait_for(lock, std::chrono::seconds(1));
      if (stopping_ || registry == nullptr || getpid() != owner_) break;
      lock.unlock();
      std::vector<std::shared_ptr<EngineSlot>> released;
      {
        std::lock_guard<std::mutex> reg_lock(registry->mutex);
        released = take_gone_slots(*registry, nullptr);
      }
      release(released);
      lock.lock();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable() && getpid() == owner_) thread_.join();
  }

  const pid_t owner_ = getpid();  // a forked child has no copy of this thread
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace

std::shared_ptr<FusedEngine> FusedEngine::of(c10d::ProcessGroup& group) {
  Registry& reg = the_registry();
  const std::string name = group.getGroupName();
  std::shared_ptr<EngineSlot> slot;
  std::vector<std::shared_ptr<EngineSlot>> released;  // destroyed after the registry lock is dropped
  {
    std::lock_guard<std::mutex> lock(reg.mutex);
    auto inherited = reg.inherited.find(name);
    TORCH_CHECK(inherited == reg.inherited.end() || inherited->second != &group, current_op(), ": process group '",
                name, "' was set up for the CPU fused engine by process ", reg.parent,
                " before it forked this process (pid ", getpid(),
                "); its shared windows and comm threads belong to the parent. Create process groups in the child "
                "(or start workers with the 'spawn' method) to call gemm_allreduce there.");
    released = take_gone_slots(reg, &group);
    auto& entry = reg.slots[name];
    if (entry == nullptr || entry->group != &group || entry->alive.expired()) {
      if (entry != nullptr) released.push_back(std::move(entry));  // a new group under a reused name
      entry = std::make_shared<EngineSlot>(group);
    }
    slot = entry;
  }
  release(released);
  GroupReaper::start();
  std::unique_lock<std::mutex> whole_process;
  if (test_hooks::process_wide_setup_lock()) {
    static std::mutex one_setup_at_a_time;  // the negative control's bug, never the default
    whole_process = std::unique_lock<std::mutex>(one_setup_at_a_time);
  }
  std::lock_guard<std::mutex> setup(slot->setup_mutex);
  // A setup that failed (a peer never came) left no engine: the next call tries again.
  if (slot->engine == nullptr) slot->engine.reset(new FusedEngine(group));
  return slot->engine;
}

}  // namespace gemm_ar::cpu
