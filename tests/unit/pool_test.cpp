#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "pool.hpp"

namespace ferry {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST_CASE("pool rounds down to whole blocks", "[pool]") {
  auto pool = StagingPool::create(5 * 8192 + 4096, 8192);
  REQUIRE(pool.ok());
  CHECK((*pool)->blocks() == 5);
  CHECK((*pool)->block_bytes() == 8192);
  CHECK((*pool)->bytes() == 5 * 8192);
  CHECK((*pool)->free_blocks() == 5);
  CHECK(reinterpret_cast<uintptr_t>((*pool)->base()) % 4096 == 0);

  auto one = StagingPool::create(4096, 4096);
  REQUIRE(one.ok());
  CHECK((*one)->blocks() == 1);
}

TEST_CASE("pool rejects bad sizes naming the values", "[pool]") {
  auto zero = StagingPool::create(1 << 20, 0);
  REQUIRE_FALSE(zero.ok());
  CHECK(zero.status().code() == StatusCode::invalid_argument);

  auto unaligned = StagingPool::create(1 << 20, 5000);
  REQUIRE_FALSE(unaligned.ok());
  CHECK(unaligned.status().code() == StatusCode::invalid_argument);
  CHECK(contains(unaligned.status().message(), "5000"));

  auto small = StagingPool::create(4096, 8192);
  REQUIRE_FALSE(small.ok());
  CHECK(small.status().code() == StatusCode::invalid_argument);
  CHECK(contains(small.status().message(), "4096"));
  CHECK(contains(small.status().message(), "8192"));
}

TEST_CASE("pool leases: acquire all, release, reacquire, refuse stale", "[pool]") {
  auto created = StagingPool::create(4 * 4096, 4096);
  REQUIRE(created.ok());
  StagingPool& pool = **created;
  int hook_calls = 0;
  pool.set_release_hook([&hook_calls]() { ++hook_calls; });

  std::vector<Lease> leases;
  std::set<uint32_t> indexes;
  for (int i = 0; i < 4; ++i) {
    auto l = pool.try_acquire();
    REQUIRE(l.has_value());
    leases.push_back(*l);
    indexes.insert(l->index);
  }
  CHECK(indexes.size() == 4);
  CHECK_FALSE(pool.try_acquire().has_value());
  CHECK(pool.free_blocks() == 0);

  // Every block is its own 4096-aligned, writable slice of the region.
  for (const Lease& l : leases) {
    auto p = pool.data(l);
    REQUIRE(p.ok());
    CHECK(reinterpret_cast<uintptr_t>(*p) % 4096 == 0);
    CHECK(*p == pool.base() + uint64_t{l.index} * 4096);
    std::memset(*p, static_cast<int>(l.index + 1), 4096);
  }
  for (const Lease& l : leases) {
    uint8_t* p = *pool.data(l);
    CHECK(p[0] == l.index + 1);
    CHECK(p[4095] == l.index + 1);
  }

  Lease old = leases[2];
  REQUIRE(pool.release(old).ok());
  CHECK(hook_calls == 1);
  CHECK(pool.free_blocks() == 1);

  auto data_after_release = pool.data(old);
  REQUIRE_FALSE(data_after_release.ok());
  CHECK(data_after_release.status().code() == StatusCode::invalid_argument);
  CHECK(contains(data_after_release.status().message(), "stale lease"));
  Status double_release = pool.release(old);
  CHECK(double_release.code() == StatusCode::invalid_argument);
  CHECK(hook_calls == 1);  // only successful releases call the hook

  // LIFO: the block just released comes back, under a new generation.
  auto again = pool.try_acquire();
  REQUIRE(again.has_value());
  CHECK(again->index == old.index);
  CHECK(again->generation != old.generation);
  CHECK(pool.data(*again).ok());
  CHECK_FALSE(pool.data(old).ok());
  CHECK(pool.release(old).code() == StatusCode::invalid_argument);

  Lease unknown{99, 0};
  CHECK(pool.data(unknown).status().code() == StatusCode::invalid_argument);
  CHECK(pool.release(unknown).code() == StatusCode::invalid_argument);

  leases[2] = *again;
  for (const Lease& l : leases) REQUIRE(pool.release(l).ok());
  CHECK(hook_calls == 1);  // nobody found the pool empty since
  CHECK(pool.free_blocks() == 4);
}

TEST_CASE("pool release hook runs outside the lock", "[pool]") {
  auto created = StagingPool::create(2 * 4096, 4096);
  REQUIRE(created.ok());
  StagingPool& pool = **created;
  // A waiter woken by the hook typically acquires at once: that must not
  // deadlock on the pool's mutex.
  std::optional<Lease> from_hook;
  pool.set_release_hook([&pool, &from_hook]() {
    if (!from_hook) from_hook = pool.try_acquire();
  });
  auto l = pool.try_acquire();
  auto other = pool.try_acquire();
  REQUIRE(l.has_value());
  REQUIRE(other.has_value());
  REQUIRE_FALSE(pool.try_acquire().has_value());
  REQUIRE(pool.release(*l).ok());
  REQUIRE(from_hook.has_value());
  CHECK(pool.free_blocks() == 0);
}

TEST_CASE("pool calls its release hook only when an acquire found it empty", "[pool]") {
  auto created = StagingPool::create(2 * 4096, 4096);
  REQUIRE(created.ok());
  StagingPool& pool = **created;
  int hooks = 0;
  pool.set_release_hook([&hooks]() { ++hooks; });
  auto a = pool.try_acquire();
  REQUIRE(a.has_value());
  REQUIRE(pool.release(*a).ok());
  CHECK(hooks == 0);  // nobody waits: a load's release per read wakes no actor
  a = pool.try_acquire();
  auto b = pool.try_acquire();
  REQUIRE(a.has_value());
  REQUIRE(b.has_value());
  // Two acquirers find it empty; the next release tells them, once.
  REQUIRE_FALSE(pool.try_acquire().has_value());
  REQUIRE_FALSE(pool.try_acquire().has_value());
  REQUIRE(pool.release(*a).ok());
  CHECK(hooks == 1);
  REQUIRE(pool.release(*b).ok());
  CHECK(hooks == 1);
  // Empty again, found so again: told again.
  a = pool.try_acquire();
  b = pool.try_acquire();
  REQUIRE_FALSE(pool.try_acquire().has_value());
  REQUIRE(pool.release(*b).ok());
  CHECK(hooks == 2);
  REQUIRE(pool.release(*a).ok());
  CHECK(hooks == 2);
}

TEST_CASE("pool is safe under concurrent acquire and release", "[pool]") {
  auto created = StagingPool::create(8 * 4096, 4096);
  REQUIRE(created.ok());
  StagingPool& pool = **created;
  std::atomic<int> hooks{0};
  pool.set_release_hook([&hooks]() { hooks.fetch_add(1, std::memory_order_relaxed); });
  std::atomic<int> released{0};
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, &released, &errors, t]() {
      for (int i = 0; i < 2000; ++i) {
        auto l = pool.try_acquire();
        if (!l) continue;
        auto p = pool.data(*l);
        if (!p.ok()) {
          ++errors;
          continue;
        }
        (*p)[0] = static_cast<uint8_t>(t);
        if (!pool.release(*l).ok()) ++errors;
        ++released;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(errors == 0);
  CHECK(released == 4 * 2000);  // 4 threads never hold all 8 blocks
  CHECK(hooks == 0);            // so no acquire found the pool empty
  CHECK(pool.free_blocks() == 8);
}

TEST_CASE("pool returns at once and faults its blocks in the background", "[pool]") {
  constexpr uint64_t kBlock = 8 << 20;
  const auto t0 = std::chrono::steady_clock::now();
  auto made = StagingPool::create(2ull << 30, kBlock);
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(made.ok());
  auto& pool = **made;
  // Faulting 2 GiB takes far longer than mapping it.
  CHECK(pool.faulted_blocks() < pool.blocks());
  CHECK(took < std::chrono::seconds(1));

  auto first = pool.try_acquire();
  REQUIRE(first);
  std::memset(*pool.data(*first), 1, kBlock);  // usable at once
  CHECK(pool.faulted_blocks() >= 1);
}

TEST_CASE("pool: the background faulting never changes a leased block's bytes", "[pool]") {
  // now: blocks leased before the background thread reached them are
  // faulted by the acquirer, and the thread leaves them alone. on_use: the
  // thread faults them beside their use (where faulting writes nothing;
  // elsewhere the acquirer faults them first, as for now).
  const auto faulting = GENERATE(StagingPool::Faulting::now, StagingPool::Faulting::on_use);
  constexpr uint64_t kBlock = 4 << 20;
  auto made = StagingPool::create(256 << 20, kBlock);
  REQUIRE(made.ok());
  auto& pool = **made;
  std::vector<Lease> held;
  for (int i = 0; i < 16; ++i) {
    auto l = pool.try_acquire(faulting);
    REQUIRE(l);
    held.push_back(*l);
    std::memset(*pool.data(*l), 0x5a + i, kBlock);
  }
  if (faulting == StagingPool::Faulting::now) CHECK(pool.faulted_blocks() >= held.size());
  pool.wait_prefaulted();
  CHECK(pool.faulted_blocks() == pool.blocks());
  for (size_t i = 0; i < held.size(); ++i) {
    const uint8_t* p = *pool.data(held[i]);
    uint64_t wrong = 0;
    for (uint64_t off = 0; off < kBlock; ++off) wrong += p[off] != static_cast<uint8_t>(0x5a + i);
    CHECK(wrong == 0);
    REQUIRE(pool.release(held[i]).ok());
  }
}

// Every CPU busy at normal priority, as in a training job, until destroyed.
class BusyCpus {
 public:
  BusyCpus() {
    const unsigned n = std::max(2u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < n; ++i)
      threads_.emplace_back([this] {
        while (!stop_.load(std::memory_order_relaxed)) {
        }
      });
  }
  ~BusyCpus() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// Faulting the pool holds the process's mmap lock. At idle priority, in a
// 32 MiB block per call, a busy machine preempted the holder and stalled
// every mmap of the process for up to 5 s here (a rank missed its
// heartbeats); at normal priority, a huge page per call, the worst was 24 ms.
TEST_CASE("pool: faulting in the background never stalls the process's mmaps for long", "[pool]") {
  double worst = 0;
  {
    BusyCpus busy;
    auto made = StagingPool::create(512ull << 20, 32 << 20);
    REQUIRE(made.ok());
    StagingPool& pool = **made;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (pool.faulted_blocks() < pool.blocks() && std::chrono::steady_clock::now() < deadline) {
      const auto t0 = std::chrono::steady_clock::now();
      void* p =
          ::mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      REQUIRE(p != MAP_FAILED);
      ::munmap(p, 1 << 20);
      worst = std::max(
          worst, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    CHECK(pool.faulted_blocks() == pool.blocks());
  }
  INFO("the longest mmap + munmap took " << worst << " s");
  CHECK(worst < 1.0);
}

TEST_CASE("pool: a held PrefaultPause stops the background faulting until released", "[pool]") {
  constexpr uint64_t kBlock = 4 << 20;
  auto made = StagingPool::create(512 << 20, kBlock);
  REQUIRE(made.ok());
  auto& pool = **made;
  {
    StagingPool::PrefaultPause outer(&pool);
    StagingPool::PrefaultPause inner(&pool);  // pauses nest
    const uint32_t at_pause = pool.faulted_blocks();
    // The thread stands still at the pause (without it, it would go on to
    // the end and never wait) ...
    REQUIRE(pool.wait_prefault_paused(std::chrono::seconds(10)));
    // ... after finishing at most the block it was on when the pause came.
    CHECK(pool.faulted_blocks() <= at_pause + 1);
    // Acquirers still fault what they take; the thread stays paused.
    auto l = pool.try_acquire();
    REQUIRE(l);
    std::memset(*pool.data(*l), 7, kBlock);
    REQUIRE(pool.release(*l).ok());
    CHECK(pool.faulted_blocks() < pool.blocks());
    CHECK(pool.wait_prefault_paused(std::chrono::milliseconds(0)));
  }
  pool.wait_prefaulted();  // resumed: every block faults in
  CHECK(pool.faulted_blocks() == pool.blocks());
}

TEST_CASE("pool destroyed while still faulting stops its thread", "[pool]") {
  auto made = StagingPool::create(1ull << 30, 4 << 20);
  REQUIRE(made.ok());
  auto l = (*made)->try_acquire();
  REQUIRE(l);
  made->reset();  // joins the background thread mid-way; must not hang or crash
}

// Pages of [p, p + n) the kernel holds in memory.
uint64_t resident_pages(uint8_t* p, uint64_t n) {
  std::vector<unsigned char> v(n / 4096);
  REQUIRE(::mincore(p, n, v.data()) == 0);
  return static_cast<uint64_t>(
      std::count_if(v.begin(), v.end(), [](unsigned char c) { return c & 1; }));
}

TEST_CASE("pool sized by use: blocks past the usable ones are never handed out nor touched",
          "[pool]") {
  constexpr uint64_t kBlock = 1 << 20;
  auto made = StagingPool::create(64 * kBlock, kBlock, 2 * kBlock);
  REQUIRE(made.ok());
  auto& pool = **made;
  CHECK(pool.blocks() == 2);
  CHECK(pool.capacity_blocks() == 64);
  pool.wait_prefaulted();
  std::set<uint32_t> seen;
  std::vector<Lease> held;
  while (auto l = pool.try_acquire()) {
    held.push_back(*l);
    seen.insert(l->index);
  }
  CHECK(seen == std::set<uint32_t>{0, 1});
  CHECK(resident_pages(pool.base() + 2 * kBlock, 62 * kBlock) == 0);

  // Growing wakes whoever found the pool empty, and hands out the new blocks.
  int hooks = 0;
  pool.set_release_hook([&] { ++hooks; });
  REQUIRE(pool.grow(5 * kBlock + 1).ok());  // rounded up to 6 blocks
  CHECK(hooks == 1);
  CHECK(pool.blocks() == 6);
  CHECK(pool.bytes() == 6 * kBlock);
  while (auto l = pool.try_acquire()) {
    held.push_back(*l);
    seen.insert(l->index);
  }
  CHECK(seen == std::set<uint32_t>{0, 1, 2, 3, 4, 5});
  pool.wait_prefaulted();
  CHECK(pool.faulted_blocks() == 6);
  CHECK(resident_pages(pool.base() + 6 * kBlock, 58 * kBlock) == 0);

  // Never past the capacity, never smaller.
  REQUIRE(pool.grow(1000 * kBlock).ok());
  CHECK(pool.blocks() == 64);
  REQUIRE(pool.grow(kBlock).ok());
  CHECK(pool.blocks() == 64);
  for (const Lease& l : held) REQUIRE(pool.release(l).ok());
  CHECK(pool.free_blocks() == 64);
}

TEST_CASE("pool sized by use pins the blocks it adds, and a refused pin leaves it as it was",
          "[pool]") {
  constexpr uint64_t kBlock = 1 << 20;
  auto made = StagingPool::create(16 * kBlock, kBlock, 2 * kBlock);
  REQUIRE(made.ok());
  auto& pool = **made;
  std::vector<std::pair<uint8_t*, uint64_t>> pinned;
  int unpinned = 0;
  bool refuse = false;
  HostRegistrar r;
  r.name = "test";
  r.max_segment_bytes = 3 * kBlock;
  r.pin = [&](void* p, uint64_t n) {
    if (refuse) return Status::io_error("no more pinned memory");
    pinned.emplace_back(static_cast<uint8_t*>(p), n);
    return Status::ok_status();
  };
  r.unpin = [&](void*) { ++unpinned; };
  REQUIRE(pool.register_memory(r).ok());
  REQUIRE(pinned.size() == 1);
  CHECK(pinned[0] == std::make_pair(pool.base(), 2 * kBlock));
  REQUIRE(pool.grow(7 * kBlock).ok());  // 5 more blocks in segments of 3
  REQUIRE(pinned.size() == 3);
  CHECK(pinned[1] == std::make_pair(pool.base() + 2 * kBlock, 3 * kBlock));
  CHECK(pinned[2] == std::make_pair(pool.base() + 5 * kBlock, 2 * kBlock));
  refuse = true;
  Status st = pool.grow(16 * kBlock);
  CHECK(st.code() == StatusCode::io_error);
  CHECK(contains(st.message(), "no more pinned memory"));
  CHECK(pool.blocks() == 7);
  CHECK(unpinned == 0);
  made->reset();
  CHECK(unpinned == 3);
}

}  // namespace
}  // namespace ferry
