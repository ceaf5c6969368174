// Writes that end after the call returns: how a writer thread keeps several
// parts of an object-store data file in flight (object_fs.cpp), each part
// sent from the staging block it was written from, that block held until
// the part is stored.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>

#include "ferry/status.hpp"

namespace ferry {

// A File whose writes may end after pwrite_async returns.
class AsyncWriteFile {
 public:
  virtual ~AsyncWriteFile() = default;
  // pwrite, handed off: `done` runs once the bytes are stored or failed
  // (maybe on another thread, maybe before this returns); `data` must stay
  // valid until then.
  virtual void pwrite_async(const void* data, size_t len, uint64_t offset,
                            std::function<void(Status)> done) = 0;
};

// Calls `done` once, with the first failure, after the owner's end() and
// one end() per add(). Shared (std::shared_ptr) by the pieces it waits for.
class JoinedDone {
 public:
  explicit JoinedDone(std::function<void(Status)> done) : done_(std::move(done)) {}
  void add() {
    std::lock_guard<std::mutex> lock(mu_);
    ++left_;
  }
  void end(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!s.ok() && first_.ok()) first_ = std::move(s);
      if (--left_ > 0) return;
    }
    done_(std::move(first_));
  }

 private:
  std::mutex mu_;
  int left_ = 1;
  Status first_;
  std::function<void(Status)> done_;
};

}  // namespace ferry
