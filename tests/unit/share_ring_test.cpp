// The share ring a receiver offers and a sender's mapping of it: a sender
// reaches it only when it is the sealed memfd announced (size, seals, token),
// frames placed in a window never overlap the ones not yet acknowledged, and
// the receiver finds a frame's bytes only inside its sender's region.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <random>

#include "share_ring.hpp"

using ferry::PeerRing;
using ferry::RingInfo;
using ferry::ShareRing;

namespace {

constexpr uint64_t kWindow = 1ull << 20;

std::unique_ptr<ShareRing> make_ring(int32_t world) {
  auto r = ShareRing::create(world, kWindow);
  INFO(r.status().to_string());
  REQUIRE(r.ok());
  return std::move(r).value();
}

}  // namespace

TEST_CASE("share ring: a sender's bytes are what the receiver reads, in its region only",
          "[share_ring]") {
  auto ring = make_ring(3);
  const RingInfo info = ring->info();
  CHECK(info.offered());
  CHECK(info.bytes == ferry::ring_region_offset(3, kWindow));
  auto peer = PeerRing::open(info, 2, 3, kWindow);
  INFO(peer.status().to_string());
  REQUIRE(peer.ok());
  const uint64_t at = (*peer)->place(1000);
  CHECK(at == ferry::ring_region_offset(2, kWindow));
  std::memset((*peer)->at(at), 0x5a, 1000);
  const uint8_t* got = ring->frame(2, at, 1000);
  REQUIRE(got != nullptr);
  CHECK(got[0] == 0x5a);
  CHECK(got[999] == 0x5a);
  // Not the sender's region, past it, empty, or no such sender.
  CHECK(ring->frame(1, at, 1000) == nullptr);
  CHECK(ring->frame(2, at + ferry::ring_region_bytes(kWindow) - 10, 11) == nullptr);
  CHECK(ring->frame(2, at + ferry::ring_region_bytes(kWindow) - 10, 10) != nullptr);
  CHECK(ring->frame(2, at - 1, 10) == nullptr);
  CHECK(ring->frame(2, at, 0) == nullptr);
  CHECK(ring->frame(3, ferry::ring_region_offset(3, kWindow), 1) == nullptr);
  CHECK(ring->frame(-1, 0, 1) == nullptr);
  CHECK(ring->frame(2, ~uint64_t{0} - 4, 8) == nullptr);
  // A rank with no region in it, or a world it was not made for.
  CHECK_FALSE(PeerRing::open(info, 3, 3, kWindow).ok());
  CHECK_FALSE(PeerRing::open(info, 1, 4, kWindow).ok());
}

TEST_CASE("share ring: a sender whose share-window differs uses the receiver's regions",
          "[share_ring]") {
  auto ring = make_ring(2);
  // Smaller: it fits in the receiver's region, which it uses whole.
  auto small = PeerRing::open(ring->info(), 1, 2, kWindow / 4);
  INFO(small.status().to_string());
  REQUIRE(small.ok());
  const uint64_t at = (*small)->place(100);
  CHECK(at == ferry::ring_region_offset(1, kWindow));
  CHECK(ring->frame(1, at, 100) != nullptr);
  // Larger: its frames in flight would not fit; it sends frames instead.
  auto large = PeerRing::open(ring->info(), 1, 2, kWindow * 2);
  REQUIRE_FALSE(large.ok());
  CHECK_THAT(large.status().message(), Catch::Contains("no region of"));
}

TEST_CASE("share ring: another process writes it through /proc", "[share_ring]") {
  auto ring = make_ring(2);
  const RingInfo info = ring->info();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto peer = PeerRing::open(info, 1, 2, kWindow);
    if (!peer.ok()) _exit(2);
    const uint64_t at = (*peer)->place(64);
    std::memcpy((*peer)->at(at), "written by the sender process", 30);
    _exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const uint8_t* got = ring->frame(1, ferry::ring_region_offset(1, kWindow), 30);
  REQUIRE(got != nullptr);
  CHECK(std::string(reinterpret_cast<const char*>(got), 29) == "written by the sender process");
}

TEST_CASE("share ring: a sender refuses what is not the ring announced", "[share_ring]") {
  auto ring = make_ring(2);
  SECTION("another token") {
    RingInfo info = ring->info();
    info.token ^= 1;
    auto peer = PeerRing::open(info, 1, 2, kWindow);
    REQUIRE_FALSE(peer.ok());
    CHECK_THAT(peer.status().message(), Catch::Contains("token"));
  }
  SECTION("another size") {
    RingInfo info = ring->info();
    info.bytes += 4096;
    auto peer = PeerRing::open(info, 1, 2, kWindow);
    REQUIRE_FALSE(peer.ok());
    CHECK_THAT(peer.status().message(), Catch::Contains("not the sealed ring"));
  }
  SECTION("a file that could shrink under the sender") {
    const int fd = ::memfd_create("not-sealed", MFD_CLOEXEC);
    REQUIRE(fd >= 0);
    const RingInfo real = ring->info();
    REQUIRE(::ftruncate(fd, static_cast<off_t>(real.bytes)) == 0);
    RingInfo info{static_cast<uint32_t>(::getpid()), fd, real.bytes, real.token};
    auto peer = PeerRing::open(info, 1, 2, kWindow);
    ::close(fd);
    REQUIRE_FALSE(peer.ok());
    CHECK_THAT(peer.status().message(), Catch::Contains("not the sealed ring"));
  }
  SECTION("no such descriptor") {
    RingInfo info = ring->info();
    info.fd = 100000;
    CHECK_FALSE(PeerRing::open(info, 1, 2, kWindow).ok());
  }
  SECTION("nothing offered") {
    CHECK_FALSE(PeerRing::open(RingInfo{}, 1, 2, kWindow).ok());
  }
}

TEST_CASE("share ring: frames within a window never overlap those not yet acknowledged",
          "[share_ring]") {
  auto ring = make_ring(1);
  auto peer = PeerRing::open(ring->info(), 0, 1, kWindow);
  REQUIRE(peer.ok());
  const uint64_t step = ferry::share_frame_bytes(kWindow);
  const uint64_t lo = ferry::ring_region_offset(0, kWindow);
  const uint64_t hi = lo + ferry::ring_region_bytes(kWindow);
  std::mt19937_64 rng(7);
  std::deque<std::pair<uint64_t, uint64_t>> in_flight;  // (offset, bytes), oldest first
  uint64_t outstanding = 0;
  for (int i = 0; i < 20000; ++i) {
    const uint64_t n = 1 + rng() % step;
    // The window: acks (oldest first) until the frame fits.
    while (outstanding + n > kWindow) {
      outstanding -= in_flight.front().second;
      in_flight.pop_front();
    }
    const uint64_t at = (*peer)->place(n);
    REQUIRE(at >= lo);
    REQUIRE(at + n <= hi);
    for (const auto& [o, k] : in_flight) REQUIRE((at + n <= o || o + k <= at));
    in_flight.emplace_back(at, n);
    outstanding += n;
    // Now and then every frame is acknowledged.
    if (rng() % 50 == 0) {
      in_flight.clear();
      outstanding = 0;
    }
  }
}
