// The bounded staging pool: one mmap'd, page-aligned region cut into equal
// blocks, allocated once and reused by every save. A pool may start with
// only some of its blocks in use (pool-bytes = auto) and grow up to the
// whole region: untouched address space costs no memory, so a small job's
// process stays small. Blocks are handed out as
// leases (index + generation); releasing bumps the generation, so a stale
// lease is refused. Thread-safe.
//
// Pre-faulting. A copy into fresh pages runs at a fraction of the speed of
// one into faulted-in pages, but faulting a large pool takes seconds, too
// long to wait for at start. So create() maps the pool and returns at once; a
// background thread then faults the blocks in, lowest first (the order
// try_acquire hands them out), and try_acquire faults a block not reached yet
// itself, so a save waits only for the blocks it uses.
//
// Where the kernel has MADV_POPULATE_WRITE (Linux 5.14+), faulting writes
// nothing: it may run beside a block's use, and a load faults only the pages
// its reads land in. The thread keeps normal priority: populating holds the
// process's mmap lock, and a thread at idle priority that a busy machine
// preempted while holding it stalled every mmap of the process for seconds
// (a rank then missed its heartbeats). Without it, faulting writes a byte
// per page, so a block is faulted exactly once, by whoever claims it first,
// and an acquirer waits for the thread if it is on that very block.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
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
  // `initial_bytes` (0: all of `bytes`) is what is usable, and faulted in,
  // until grow() adds more; at least one block.
  static Result<std::unique_ptr<StagingPool>> create(uint64_t bytes, uint64_t block_bytes,
                                                     uint64_t initial_bytes = 0);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // How an acquirer wants a block not faulted in yet: faulted first (the
  // caller copies into it at memory speed), or left to the caller's own use
  // to fault the pages it touches (a read into part of a block; the kernel
  // faults an O_DIRECT read's pages as it pins them). on_use needs faulting
  // that writes nothing, and is `now` where the kernel lacks it.
  enum class Faulting : uint8_t { now, on_use };
  std::optional<Lease> try_acquire(Faulting faulting = Faulting::now);
  // The block's memory, or invalid_argument for a stale/unknown lease.
  Result<uint8_t*> data(const Lease& l) const;
  Status release(const Lease& l);
  // Called (outside the lock) after a release that follows a try_acquire
  // that found no free block: whoever waits for one hears of it, and a pool
  // nobody waits on sends nothing (a load releases a block per read, and
  // each call woke an actor thread for nothing).
  void set_release_hook(std::function<void()> hook);

  uint64_t block_bytes() const { return block_bytes_; }
  // Blocks usable now (grow() adds more, up to capacity_blocks()).
  uint32_t blocks() const { return active_.load(std::memory_order_acquire); }
  uint32_t capacity_blocks() const { return static_cast<uint32_t>(generation_.size()); }
  // Makes at least `bytes` (rounded up to blocks, at most the capacity)
  // usable; the new blocks are pinned first where the pool is registered.
  // A failed pin leaves the pool as it was and says why. Never shrinks.
  Status grow(uint64_t bytes);
  uint32_t free_blocks() const;
  uint64_t bytes() const { return block_bytes_ * blocks(); }
  uint8_t* base() const { return base_; }
  // Blocks faulted in so far (by the background thread or by try_acquire).
  uint32_t faulted_blocks() const;
  // Blocks until every usable block is faulted in (benchmarks: warm memory).
  void wait_prefaulted() const;
  // Waits up to `timeout` for the background thread to stand still at a
  // PrefaultPause; false if it did not (no pause held, or nothing left).
  bool wait_prefault_paused(std::chrono::milliseconds timeout) const;
  // While one is held the background thread faults no further block (the
  // one it is on finishes). A load holds one: a job that restarts loads
  // right after start, and faulting a large pool beside that load took
  // 0.15-1.2 CPU-s per GiB here, the CPU the readers and the disk needed.
  // The load's own blocks fault on use; the rest resume after it. A pause
  // must not outlive its pool.
  class PrefaultPause {
   public:
    explicit PrefaultPause(StagingPool* pool);
    ~PrefaultPause();
    PrefaultPause(const PrefaultPause&) = delete;
    PrefaultPause& operator=(const PrefaultPause&) = delete;

   private:
    StagingPool* pool_;
  };

  // Pins the usable blocks with `r` (grow() pins the ones it adds), in segments of at most
  // r.max_segment_bytes, so device copies go straight into it (and O_DIRECT writes straight out).
  // Call once, at start, before any block is used. On failure the segments
  // already pinned are unpinned and the error names the pool size. The pool
  // unpins itself when destroyed. REQUIRES: not registered yet.
  Status register_memory(HostRegistrar r);
  bool registered() const { return !pinned_.empty(); }

 private:
  enum class Fault : uint8_t { no, running, done };
  StagingPool(uint8_t* base, uint64_t block_bytes, uint32_t blocks, uint32_t active,
              bool can_populate);
  // Pins [from, to) in the registrar's segments; unpins its own on failure.
  Status pin_range(const HostRegistrar& r, uint64_t from, uint64_t to,
                   std::vector<uint8_t*>& pinned) const;
  void prefault();
  // Faults block `index` in. Without populate_ it writes a byte per page,
  // which only the block's claimer may do, before its use.
  void fault_in(uint32_t index);
  void fault_done(uint32_t index);  // REQUIRES: mu_ held
  uint8_t* base_;
  uint64_t block_bytes_;
  mutable std::mutex mu_;
  std::vector<uint32_t> generation_;
  std::vector<bool> in_use_;
  std::vector<uint32_t> free_;
  std::atomic<uint32_t> active_{0};  // usable blocks: [0, active_); written under mu_
  std::mutex grow_mu_;               // one grow() at a time (pinning runs outside mu_)
  std::function<void()> hook_;
  bool starved_ = false;  // a try_acquire found no block since the last hook call
  HostRegistrar registrar_;
  std::vector<uint8_t*> pinned_;  // segment starts, in pin order
  std::vector<Fault> fault_;      // by block, under mu_
  bool populate_ = true;          // MADV_POPULATE_WRITE works; set before the thread starts
  uint32_t faulted_ = 0;
  mutable std::condition_variable fault_cv_;  // a block became Fault::done, or the thread paused
  bool stop_ = false;
  uint32_t pauses_ = 0;                // PrefaultPause objects alive, under mu_
  bool paused_ = false;                // the thread waits on resume_cv_, under mu_
  std::condition_variable resume_cv_;  // stop_ set, pauses_ back to 0, or the pool grew
  std::thread prefault_thread_;
};

}  // namespace ferry
