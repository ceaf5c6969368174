#include "checksum.hpp"

#include <catch2/catch.hpp>

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

// Checkpoints written before the dispatched (AVX2) hash must still verify:
// every path must give XXH3-64's defined value, whatever the CPU.
TEST_CASE("checksum: xxh3 gives the defined hashes, one-shot and streamed", "[checksum]") {
  // XXH3-64 (seed 0) of the empty input, a published constant.
  REQUIRE(ferry::xxh3_64(nullptr, 0) == 0x2D06800538D394C2ULL);

  std::mt19937_64 rng(7);
  std::vector<uint8_t> buf((3u << 20) + 13);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  // Lengths across XXH3's internal regimes (short, mid, long, several
  // stripes and blocks), at an odd offset so nothing is aligned.
  for (size_t n :
       {size_t{1}, size_t{3}, size_t{16}, size_t{17}, size_t{128}, size_t{129}, size_t{240},
        size_t{241}, size_t{1024}, size_t{65537}, size_t{1} << 20, buf.size() - 1}) {
    const uint8_t* p = buf.data() + 1;
    const uint64_t want = XXH3_64bits(p, n);  // the portable build of the library
    CHECK(ferry::xxh3_64(p, n) == want);
    ferry::StreamingChecksum s;
    for (size_t at = 0; at < n;) {
      const size_t piece = std::min<size_t>(n - at, 1 + rng() % 300000);
      s.update(p + at, piece);
      at += piece;
    }
    CHECK(s.digest() == want);
    s.reset();
    s.update(p, n);
    CHECK(s.digest() == want);
  }
}

// The load copies checked blocks with xxh3_64_copy: its sum must be XXH3-64's
// and its copy exact, at every length regime and any alignment of either
// side (the one-pass path stores aligned 32-byte vectors after a head
// copied apart), without touching a byte outside the destination.
TEST_CASE("checksum: hashing while copying gives xxh3 and the same bytes", "[checksum]") {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> src((2u << 20) + 300);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> dst(src.size() + 256);
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{240}, size_t{241}, size_t{255},
                   size_t{1024}, size_t{1025}, size_t{1087}, size_t{4096}, size_t{65536 + 17},
                   size_t{1} << 20, (size_t{2} << 20) + 1})
    for (size_t from : {size_t{0}, size_t{1}, size_t{32}})
      for (size_t to : {size_t{0}, size_t{8}, size_t{16}, size_t{31}, size_t{32}, size_t{64}}) {
        INFO("length " << n << ", source +" << from << ", destination +" << to);
        // dst.data() is 16-aligned at least: round up so `to` is what counts.
        uint8_t* base = dst.data() + ((64 - reinterpret_cast<uintptr_t>(dst.data()) % 64) % 64);
        std::fill(dst.begin(), dst.end(), uint8_t{0xA5});
        const uint8_t* p = src.data() + from;
        CHECK(ferry::xxh3_64_copy(base + to, p, n) == XXH3_64bits(p, n));
        CHECK(std::memcmp(base + to, p, n) == 0);
        CHECK(base[to + n] == 0xA5);
        if (to > 0) CHECK(base[to - 1] == 0xA5);
      }
}
