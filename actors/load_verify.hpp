// Checksum checks and device copies of loaded bytes: the readers and the share wait both use them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "actors/context.hpp"
#include "actors/messages.hpp"

namespace ferry {

// A load's tensors into which bytes landed that did not pass their checksum:
// a block copied and summed in one pass, or read straight into its tensor,
// whose sum then failed or was never taken because the load stopped first.
// A failed load names them (the others hold only checked bytes, old or new).
class UnverifiedTensors {
 public:
  void add(const std::string& key) {
    std::lock_guard<std::mutex> l(mu_);
    keys_.insert(key);
  }
  // `s` with the tensors named, at most kShown of them.
  Status name_in(const Status& s) const {
    std::lock_guard<std::mutex> l(mu_);
    if (s.ok() || keys_.empty()) return s;
    constexpr size_t kShown = 8;
    std::string list;
    size_t i = 0;
    for (const std::string& k : keys_) {
      if (i++ == kShown) break;
      list += (list.empty() ? "'" : ", '") + k + "'";
    }
    if (keys_.size() > kShown) list += " and " + std::to_string(keys_.size() - kShown) + " more";
    return Status(s.code(), s.message() + " (unverified bytes were left in tensor" +
                                (keys_.size() > 1 ? "s " : " ") + list + ")");
  }

 private:
  mutable std::mutex mu_;
  std::set<std::string> keys_;
};

// Waits for the copies of one run: the staging block is reused only after
// every copy out of it has landed (a device copies asynchronously).
class CopyLatch {
 public:
  void add() {
    std::lock_guard<std::mutex> l(mu_);
    ++issued_;
  }
  void arrive(Status s) {
    std::lock_guard<std::mutex> l(mu_);
    if (!s.ok() && first_.ok()) first_ = std::move(s);
    ++done_;
    cv_.notify_all();
  }
  Status wait() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return done_ == issued_; });
    return first_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t issued_ = 0, done_ = 0;
  Status first_;
};

// Verifies every checksum block of one read (a chunk saved without
// checksums has none to check).
Status verify_blocks(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                     const std::string& path, const uint8_t* buf);

// Copies `runs` (offsets past `src`) into `target` through the device, one
// batch; the batch reports to `latch`. `key` outlives the latch's wait.
void copy_runs(const RankContext& ctx, const std::string& key, const uint8_t* src,
               const TensorView& target, const std::vector<DeviceBackend::Run>& runs,
               CopyLatch& latch);

// Verifies the checksum blocks of one read (at `buf`) and copies its bytes
// into `target`, a block at a time: the copy reads each block while the hash
// has just left it in the CPU's cache, which saved a sixth of the time of
// hashing all and then copying all (2 GiB, measured here). A block that goes
// whole to one stretch of the tensor is copied and summed in one pass where
// the device can (copy_in_summed: 0.115 against 0.145 s per 2 GiB here): its
// bytes land before they are checked, and a mismatch fails the load as
// before (a failed load leaves its tensors partly loaded either way). Any
// other byte reaches the tensor only after its block checked out. Copies
// started report to `latch`.
Status verify_and_copy(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                       const std::string& path, const uint8_t* buf, const TensorView& target,
                       CopyLatch& latch, UnverifiedTensors* unverified);

}  // namespace ferry
