#include "pool.hpp"

#include "populate.hpp"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

namespace ferry {
namespace {

constexpr uint64_t kPageBytes = 4096;

std::string lease_text(const Lease& l) {
  return "block " + std::to_string(l.index) + " generation " + std::to_string(l.generation);
}

}  // namespace

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL
#endif

bool populate_pages(void* p, uint64_t n) {
  constexpr uint64_t kStep = 2 << 20;
  auto* b = static_cast<uint8_t*>(p);
  for (uint64_t at = 0; at < n; at += kStep) {
    const uint64_t k = std::min(kStep, n - at);
    if (::madvise(b + at, static_cast<size_t>(k), MADV_POPULATE_WRITE) != 0) return false;
  }
  return true;
}

Result<std::unique_ptr<StagingPool>> StagingPool::create(uint64_t bytes, uint64_t block_bytes,
                                                         uint64_t initial_bytes) {
  if (block_bytes == 0 || block_bytes % kPageBytes != 0) {
    return Status::invalid_argument("staging pool: block_bytes " + std::to_string(block_bytes) +
                                    " is not a positive multiple of 4096");
  }
  if (bytes < block_bytes) {
    return Status::invalid_argument("staging pool: pool bytes " + std::to_string(bytes) +
                                    " is smaller than block_bytes " + std::to_string(block_bytes));
  }
  uint64_t blocks = bytes / block_bytes;
  if (blocks > std::numeric_limits<uint32_t>::max()) {
    return Status::invalid_argument("staging pool: " + std::to_string(blocks) + " blocks of " +
                                    std::to_string(block_bytes) +
                                    " bytes exceed the 2^32-1 a lease can index");
  }
  uint64_t total = blocks * block_bytes;
  if (total > std::numeric_limits<size_t>::max()) {
    return Status::invalid_argument("staging pool: " + std::to_string(total) +
                                    " bytes do not fit the address space");
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(total), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status::io_error("staging pool: mmap of " + std::to_string(total) +
                            " bytes failed: " + std::strerror(errno));
  }
  // A forked child (a launcher, a subprocess of the training script) must not
  // share or copy-on-write pages that the device may be DMA-ing into.
  if (::madvise(p, static_cast<size_t>(total), MADV_DONTFORK) != 0) {
    int err = errno;
    ::munmap(p, static_cast<size_t>(total));
    return Status::io_error("staging pool: madvise(MADV_DONTFORK) of " + std::to_string(total) +
                            " bytes failed: " + std::strerror(err));
  }
  // Fewer TLB misses on big copies; only a hint, so a refusal is fine.
  (void)::madvise(p, static_cast<size_t>(total), MADV_HUGEPAGE);
  // Which way blocks fault (see pool.hpp), tried on the first page.
  const bool can_populate = populate_pages(p, kPageBytes);
  const uint64_t active =
      initial_bytes == 0
          ? blocks
          : std::clamp<uint64_t>((initial_bytes + block_bytes - 1) / block_bytes, 1, blocks);
  // Faulted in the background (see pool.hpp): start returns at once.
  return std::unique_ptr<StagingPool>(new StagingPool(static_cast<uint8_t*>(p), block_bytes,
                                                      static_cast<uint32_t>(blocks),
                                                      static_cast<uint32_t>(active), can_populate));
}

StagingPool::StagingPool(uint8_t* base, uint64_t block_bytes, uint32_t blocks, uint32_t active,
                         bool can_populate)
    : base_(base),
      block_bytes_(block_bytes),
      generation_(blocks, 0),
      in_use_(blocks, false),
      fault_(blocks, Fault::no),
      populate_(can_populate) {
  free_.reserve(blocks);
  // Pushed in reverse so the first acquisitions hand out low indexes.
  for (uint32_t i = active; i > 0; --i) free_.push_back(i - 1);
  active_.store(active, std::memory_order_release);
  prefault_thread_ = std::thread([this] { prefault(); });
  (void)pthread_setname_np(prefault_thread_.native_handle(), "ferry.prefault");
}

StagingPool::~StagingPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  resume_cv_.notify_all();
  prefault_thread_.join();
  // Unpinned before the unmap: the device must not keep a mapping of pages
  // that go back to the kernel.
  for (auto it = pinned_.rbegin(); it != pinned_.rend(); ++it) registrar_.unpin(*it);
  ::munmap(base_, static_cast<size_t>(block_bytes_ * capacity_blocks()));
}

void StagingPool::fault_in(uint32_t index) {
  uint8_t* b = base_ + static_cast<uint64_t>(index) * block_bytes_;
  if (populate_) {
    // A failure (no memory) leaves the pages to fault on use.
    (void)populate_pages(b, block_bytes_);
    return;
  }
  for (uint64_t off = 0; off < block_bytes_; off += kPageBytes) b[off] = 0;
}

void StagingPool::fault_done(uint32_t index) {
  if (fault_[index] == Fault::done) return;  // the thread and an acquirer both populated it
  fault_[index] = Fault::done;
  ++faulted_;
  fault_cv_.notify_all();
}

void StagingPool::prefault() {
  for (uint32_t i = 0; i < capacity_blocks(); ++i) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Blocks past the usable ones wait for a grow(); most pools never do.
      resume_cv_.wait(lock, [&] { return stop_ || i < blocks(); });
      if (!stop_ && pauses_ > 0) {
        paused_ = true;
        fault_cv_.notify_all();
        resume_cv_.wait(lock, [&] { return stop_ || pauses_ == 0; });
        paused_ = false;
      }
      if (stop_) return;
      // Claimed by an acquirer, or done. With populate_, a block leased
      // on_use is still Fault::no and is faulted here beside its use.
      if (fault_[i] != Fault::no) continue;
      fault_[i] = Fault::running;
    }
    fault_in(i);
    std::lock_guard<std::mutex> lock(mu_);
    fault_done(i);
  }
}

StagingPool::PrefaultPause::PrefaultPause(StagingPool* pool) : pool_(pool) {
  std::lock_guard<std::mutex> lock(pool_->mu_);
  ++pool_->pauses_;
}

StagingPool::PrefaultPause::~PrefaultPause() {
  {
    std::lock_guard<std::mutex> lock(pool_->mu_);
    if (--pool_->pauses_ > 0) return;
  }
  pool_->resume_cv_.notify_all();
}

std::optional<Lease> StagingPool::try_acquire(Faulting faulting) {
  std::unique_lock<std::mutex> lock(mu_);
  if (free_.empty()) {
    starved_ = true;
    return std::nullopt;
  }
  // LIFO: the block released last is the one most likely still in cache.
  uint32_t index = free_.back();
  free_.pop_back();
  in_use_[index] = true;
  const Lease lease{index, generation_[index]};
  if (fault_[index] == Fault::done || (populate_ && faulting == Faulting::on_use)) return lease;
  if (fault_[index] == Fault::no || populate_) {
    // Not reached by the background thread yet: fault just this block. With
    // populate_, also a block the thread is on: neither writes, so no wait.
    if (fault_[index] == Fault::no) fault_[index] = Fault::running;
    lock.unlock();
    fault_in(index);
    lock.lock();
    fault_done(index);
  } else {
    fault_cv_.wait(lock, [&] { return fault_[index] == Fault::done; });
  }
  return lease;
}

uint32_t StagingPool::faulted_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return faulted_;
}

void StagingPool::wait_prefaulted() const {
  std::unique_lock<std::mutex> lock(mu_);
  fault_cv_.wait(lock, [&] { return faulted_ == blocks(); });
}

bool StagingPool::wait_prefault_paused(std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  return fault_cv_.wait_for(lock, timeout, [&] { return paused_; });
}

Result<uint8_t*> StagingPool::data(const Lease& l) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (l.index >= generation_.size() || !in_use_[l.index] || generation_[l.index] != l.generation) {
    return Status::invalid_argument("stale lease: " + lease_text(l) + " is not held");
  }
  return base_ + static_cast<uint64_t>(l.index) * block_bytes_;
}

Status StagingPool::release(const Lease& l) {
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (l.index >= generation_.size() || !in_use_[l.index] ||
        generation_[l.index] != l.generation) {
      return Status::invalid_argument("stale lease: cannot release " + lease_text(l));
    }
    ++generation_[l.index];
    in_use_[l.index] = false;
    free_.push_back(l.index);
    if (starved_) hook = hook_;
    starved_ = false;
  }
  // Outside the lock: the hook typically wakes an actor that acquires again.
  if (hook) hook();
  return Status::ok_status();
}

Status StagingPool::pin_range(const HostRegistrar& r, uint64_t from, uint64_t to,
                              std::vector<uint8_t*>& pinned) const {
  // A segment boundary on a block boundary keeps every block in one segment.
  uint64_t seg = r.max_segment_bytes == 0 ? to - from : r.max_segment_bytes;
  seg = std::max<uint64_t>(block_bytes_, seg / block_bytes_ * block_bytes_);
  std::vector<uint8_t*> done;
  for (uint64_t off = from; off < to; off += seg) {
    const uint64_t n = std::min(seg, to - off);
    Status st = r.pin(base_ + off, n);
    if (!st.ok()) {
      for (auto it = done.rbegin(); it != done.rend(); ++it) r.unpin(*it);
      return Status(st.code(), "staging pool of " + std::to_string(to) + " bytes (" +
                                   std::to_string(to / block_bytes_) + " blocks of " +
                                   std::to_string(block_bytes_) +
                                   ") could not be registered with " + r.name + ": segment at +" +
                                   std::to_string(off) + " of " + std::to_string(n) +
                                   " bytes: " + st.message());
    }
    done.push_back(base_ + off);
  }
  pinned.insert(pinned.end(), done.begin(), done.end());
  return Status::ok_status();
}

Status StagingPool::register_memory(HostRegistrar r) {
  std::lock_guard<std::mutex> g(grow_mu_);
  if (!pinned_.empty())
    return Status::invalid_argument("staging pool: already registered with " + registrar_.name);
  if (!r.pin || !r.unpin)
    return Status::invalid_argument("staging pool: registrar " + r.name + " lacks pin/unpin");
  std::vector<uint8_t*> done;
  FERRY_RETURN_IF_ERROR(pin_range(r, 0, bytes(), done));
  registrar_ = std::move(r);
  pinned_ = std::move(done);
  return Status::ok_status();
}

Status StagingPool::grow(uint64_t want) {
  std::lock_guard<std::mutex> g(grow_mu_);
  const uint64_t target =
      std::min<uint64_t>((want + block_bytes_ - 1) / block_bytes_, capacity_blocks());
  const uint32_t from = blocks();
  if (target <= from) return Status::ok_status();
  // grow_mu_ keeps pinned_ and registrar_ still; the new blocks are no
  // one's until they are pushed below.
  if (!pinned_.empty())
    FERRY_RETURN_IF_ERROR(
        pin_range(registrar_, uint64_t{from} * block_bytes_, target * block_bytes_, pinned_));
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Below the free ones, so blocks already faulted in go out first.
    free_.insert(free_.begin(), target - from, 0);
    for (uint32_t i = from; i < target; ++i) free_[target - 1 - i] = i;
    active_.store(static_cast<uint32_t>(target), std::memory_order_release);
    if (starved_) hook = hook_;
    starved_ = false;
  }
  resume_cv_.notify_all();
  if (hook) hook();
  return Status::ok_status();
}

void StagingPool::set_release_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  hook_ = std::move(hook);
}

uint32_t StagingPool::free_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<uint32_t>(free_.size());
}

}  // namespace ferry
