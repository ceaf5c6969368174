// The bounded staging pool: one mmap'd, page-aligned, pre-faulted region cut
// into equal blocks, allocated once and reused by every save. Blocks are
// handed out as leases (index + generation); releasing bumps the generation,
// so a stale lease is refused. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ferry/status.hpp"

namespace ferry {

// How a device pins host memory for its copy engines (cudaHostRegister):
// given by the device backend, applied once by StagingPool::register_memory.
struct HostRegistrar {
  std::string name;                // for messages: "CUDA"
  uint64_t max_segment_bytes = 0;  // one pin call covers at most this; 0 = no limit
  std::function<Status(void* ptr, uint64_t bytes)> pin;
  std::function<void(void* ptr)> unpin;
};

struct Lease {
  uint32_t index = 0;
  uint32_t generation = 0;
  bool operator==(const Lease& o) const { return index == o.index && generation == o.generation; }
};

class StagingPool {
 public:
  // block_bytes must be a positive multiple of 4096; bytes >= block_bytes.
  static Result<std::unique_ptr<StagingPool>> create(uint64_t bytes, uint64_t block_bytes);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  std::optional<Lease> try_acquire();
  // The block's memory, or invalid_argument for a stale/unknown lease.
  Result<uint8_t*> data(const Lease& l) const;
  Status release(const Lease& l);
  // Called (outside the lock) after every successful release.
  void set_release_hook(std::function<void()> hook);

  uint64_t block_bytes() const { return block_bytes_; }
  uint32_t blocks() const { return static_cast<uint32_t>(generation_.size()); }
  uint32_t free_blocks() const;
  uint64_t bytes() const { return block_bytes_ * blocks(); }
  uint8_t* base() const { return base_; }

  // Pins the whole pool with `r`, in segments of at most r.max_segment_bytes,
  // so device copies go straight into it (and O_DIRECT writes straight out).
  // Call once, at start, before any block is used. On failure the segments
  // already pinned are unpinned and the error names the pool size. The pool
  // unpins itself when destroyed. REQUIRES: not registered yet.
  Status register_memory(HostRegistrar r);
  bool registered() const { return !pinned_.empty(); }

 private:
  StagingPool(uint8_t* base, uint64_t block_bytes, uint32_t blocks);
  uint8_t* base_;
  uint64_t block_bytes_;
  mutable std::mutex mu_;
  std::vector<uint32_t> generation_;
  std::vector<bool> in_use_;
  std::vector<uint32_t> free_;
  std::function<void()> hook_;
  HostRegistrar registrar_;
  std::vector<uint8_t*> pinned_;  // segment starts, in pin order
};

}  // namespace ferry
