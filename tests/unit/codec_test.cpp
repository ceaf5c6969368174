#include "codec.hpp"

#include <catch2/catch.hpp>

#include <random>

namespace {

std::vector<uint8_t> pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng() % 7);
  return v;
}

}  // namespace

TEST_CASE("codec: frames round trip, whole and one frame at a time", "[codec][compress]") {
  for (size_t n : {size_t{0}, size_t{1}, size_t{999}, size_t{1000}, size_t{4321}}) {
    const auto raw = pattern(n, n);
    auto z = ferry::compress_frames(raw.data(), raw.size(), 3, 3, "t", 1000);
    REQUIRE(z.ok());
    REQUIRE(z->raw_bytes == n);
    REQUIRE(z->frame_ends.size() == (n + 999) / 1000);
    REQUIRE(z->data.size() == (n ? z->frame_ends.back() : 0));
    if (n > 1000) REQUIRE(z->data.size() < n);
    std::vector<uint8_t> back(z->frame_ends.size() * 1000);
    REQUIRE(ferry::decompress_frames(z->data.data(), z->data.size(), z->frame_ends, 1000, n, 0,
                                     z->frame_ends.size(), back.data(), "t")
                .ok());
    back.resize(n);
    REQUIRE(back == raw);
    // A single frame decodes from its own stored bytes alone.
    for (size_t f = 0; f < z->frame_ends.size(); ++f) {
      const uint64_t s0 = f ? z->frame_ends[f - 1] : 0;
      std::vector<uint8_t> one(1000);
      REQUIRE(ferry::decompress_frames(z->data.data() + s0, z->frame_ends[f] - s0, z->frame_ends,
                                       1000, n, f, 1, one.data(), "t")
                  .ok());
      const size_t len = std::min<size_t>(1000, n - f * 1000);
      REQUIRE(std::equal(one.begin(), one.begin() + len, raw.begin() + f * 1000));
    }
  }
}

TEST_CASE("codec: a damaged frame is corruption naming it", "[codec][compress]") {
  const auto raw = pattern(3000, 1);
  auto z = ferry::compress_frames(raw.data(), raw.size(), 1, 2, "t", 1000);
  REQUIRE(z.ok());
  std::vector<uint8_t> back(3000);
  auto bad = z->data;
  bad[(z->frame_ends[0] + z->frame_ends[1]) / 2] ^= 0x40;
  auto st = ferry::decompress_frames(bad.data(), bad.size(), z->frame_ends, 1000, 3000, 0, 3,
                                     back.data(), "tensor 'w' of file f.ferryz");
  REQUIRE(st.code() == ferry::StatusCode::corruption);
  REQUIRE_THAT(st.message(), Catch::Contains("tensor 'w' of file f.ferryz"));
  REQUIRE_THAT(st.message(), Catch::Contains("frame 1"));
  // Truncated stored bytes.
  st = ferry::decompress_frames(z->data.data(), z->frame_ends[1], z->frame_ends, 1000, 3000, 0, 3,
                                back.data(), "t");
  REQUIRE(st.code() == ferry::StatusCode::corruption);
}

TEST_CASE("codec: compress levels", "[codec][compress]") {
  REQUIRE(ferry::compress_level("none") == 0);
  REQUIRE(ferry::compress_level("zstd:3") == 3);
  REQUIRE(ferry::compress_level("zstd:19") == 19);
}

TEST_CASE("codec: max_stored_bytes bounds what incompressible bytes take", "[codec][compress]") {
  std::mt19937_64 rng(5);
  for (size_t n : {size_t{1}, size_t{999}, size_t{1000}, size_t{2500}}) {
    std::vector<uint8_t> raw(n);
    for (auto& b : raw) b = static_cast<uint8_t>(rng());
    auto z = ferry::compress_frames(raw.data(), n, 19, 2, "t", 1000);
    REQUIRE(z.ok());
    REQUIRE(z->data.size() > n);  // random bytes grow
    REQUIRE(z->data.size() <= ferry::max_stored_bytes(n, 1000));
  }
  REQUIRE(ferry::max_stored_bytes(0, 1000) == 0);
}
