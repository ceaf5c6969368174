#include "checksum.hpp"

#include <catch2/catch.hpp>

#include <xxhash.h>

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
