// Buffers for the large frames ranks send each other, used again and again.
// A load's shared bytes travel as a stream of frames of up to 2 MiB (a
// quarter of share-window), and each took a fresh allocation on both sides:
// the sender's encoded frame and the receiver's copy. Allocations that size
// come from mmap, or from a heap top the allocator has just handed back, so
// every frame paid for first touching its pages. On the test VM that made a
// 2-rank replicated load of 2,000 tensors take 2.6-3.5 s; with the buffers
// kept it takes 2.1-2.3 s. Whoever drops a frame last returns its buffer:
// the transport once UCX has sent it, and frame_owner's holder once the
// loader has copied the bytes out. Each runtime owns one (RankContext::frames,
// shared with its transport): never process-global, so two runtimes in one
// process never take each other's buffers. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ferry {

class FrameBuffers {
 public:
  // Smaller buffers are cheap to allocate: they are not kept.
  static constexpr uint64_t kMinBytes = 256ull << 10;
  // The most one owner keeps, whatever the frames: a few windows' worth.
  static constexpr uint64_t kMaxKeptBytes = 32ull << 20;

  // An empty string with room for `n` bytes, a kept one where one is large
  // enough.
  std::string take_empty(uint64_t n) {
    std::string s = reuse(n);
    s.clear();
    s.reserve(n);
    return s;
  }

  // A string of `n` bytes to be overwritten. A kept one keeps its old bytes:
  // only those past its old size are zeroed, where a fresh one zeroes all
  // (a memset of every received frame showed in profiles).
  std::string take(uint64_t n) {
    std::string s = reuse(n);
    s.resize(n);
    return s;
  }

  // Keeps `s` for a later frame if it is large and there is room.
  void give(std::string&& s) {
    if (s.capacity() < kMinBytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (kept_bytes_ + s.capacity() > kMaxKeptBytes) return;
    kept_bytes_ += s.capacity();
    kept_.push_back(std::move(s));
  }

  uint64_t kept_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return kept_bytes_;
  }

 private:
  // A kept string with capacity for `n` bytes, as it was given back; else an
  // empty one.
  std::string reuse(uint64_t n) {
    std::string s;
    if (n < kMinBytes) return s;
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < kept_.size(); ++i) {
      if (kept_[i].capacity() < n) continue;
      s = std::move(kept_[i]);
      kept_bytes_ -= s.capacity();
      kept_[i] = std::move(kept_.back());
      kept_.pop_back();
      break;
    }
    return s;
  }

  std::mutex mu_;
  std::vector<std::string> kept_;
  uint64_t kept_bytes_ = 0;
};

// Shared ownership of a received frame whose buffer goes back to `buffers`
// (kept alive by the frame: a holder may outlive the runtime) when the last
// holder lets go (one whose bytes were moved on, as rank 0 relays them,
// leaves nothing worth keeping). Null `buffers`: the buffer is freed.
inline std::shared_ptr<std::string> frame_owner(std::string&& bytes,
                                                std::shared_ptr<FrameBuffers> buffers) {
  return std::shared_ptr<std::string>(new std::string(std::move(bytes)),
                                      [buffers = std::move(buffers)](std::string* s) {
                                        if (buffers) buffers->give(std::move(*s));
                                        delete s;
                                      });
}

}  // namespace ferry
