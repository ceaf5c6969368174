#include "replica_check.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <numeric>
#include <vector>

namespace {

using ferry::DType;
using ferry::ReplicaCheck;
using ferry::ReplicaDigest;
using ferry::TensorView;

uint64_t digest_of(const TensorView& v, ReplicaCheck mode) {
  auto d = ferry::replica_digest(*ferry::host_device(), v, mode);
  REQUIRE(d.ok());
  return *d;
}

}  // namespace

TEST_CASE("replica mode: auto is full up to the threshold, sampled above", "[replica]") {
  using ferry::kReplicaCheckFullBytes;
  CHECK(ferry::replica_mode(ReplicaCheck::automatic, kReplicaCheckFullBytes) == ReplicaCheck::full);
  CHECK(ferry::replica_mode(ReplicaCheck::automatic, kReplicaCheckFullBytes + 1) ==
        ReplicaCheck::sampled);
  CHECK(ferry::replica_mode(ReplicaCheck::full, 1ull << 40) == ReplicaCheck::full);
  CHECK(ferry::replica_mode(ReplicaCheck::sampled, 16) == ReplicaCheck::sampled);
  // Sampled: 64 windows of 4 KiB, the first at byte 0 and the last at the end.
  const uint64_t n = 10'000'019;
  auto r = ferry::replica_ranges(ReplicaCheck::sampled, n);
  REQUIRE(r.size() == 64);
  CHECK(r.front().first == 0);
  CHECK(r.back().first + r.back().second == n);
  for (size_t i = 1; i < r.size(); ++i) CHECK(r[i].first >= r[i - 1].first + r[i - 1].second);
  // Small items are hashed whole even when sampled.
  CHECK(ferry::replica_ranges(ReplicaCheck::sampled, 1000) ==
        std::vector<std::pair<uint64_t, uint64_t>>{{0, 1000}});
}

TEST_CASE("replica digest: equal bytes agree, one byte apart differs, strided = contiguous",
          "[replica]") {
  std::vector<float> a(4096), b;
  std::iota(a.begin(), a.end(), 0.5f);
  b = a;
  TensorView va(a.data(), DType::f32, {64, 64}), vb(b.data(), DType::f32, {64, 64});
  CHECK(digest_of(va, ReplicaCheck::full) == digest_of(vb, ReplicaCheck::full));
  b[4000] += 1;
  CHECK(digest_of(va, ReplicaCheck::full) != digest_of(vb, ReplicaCheck::full));
  // The same bytes as a transposed (strided) view of the transposed data.
  std::vector<float> t(4096);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) t[j * 64 + i] = a[i * 64 + j];
  TensorView vt(t.data(), DType::f32, {64, 64}, ferry::Device::host(), {1, 64});
  CHECK(digest_of(vt, ReplicaCheck::full) == digest_of(va, ReplicaCheck::full));
  CHECK(digest_of(vt, ReplicaCheck::sampled) == digest_of(va, ReplicaCheck::sampled));
  // The size is part of the digest: a prefix never matches the whole.
  TensorView half(a.data(), DType::f32, {32, 64});
  CHECK(digest_of(half, ReplicaCheck::full) != digest_of(va, ReplicaCheck::full));
}

TEST_CASE("replica digests compared: agreement passes, a differing rank is named", "[replica]") {
  const std::vector<ReplicaDigest> same = {{"step", {}, 1, false}, {"rng", {0}, 9, false}};
  std::vector<ReplicaDigest> odd = same;
  odd[1].digest = 10;
  CHECK(ferry::compare_replica_digests({{0, &same}, {1, &same}, {2, &same}}).ok());
  auto s = ferry::compare_replica_digests({{0, &same}, {1, &same}, {2, &odd}, {3, &same}});
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == ferry::StatusCode::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("tensor 'rng' (box at [0])") &&
                              Catch::Contains("ranks 0, 1, 3 hold one value, rank 2 another") &&
                              Catch::Contains("replica-check full"));
  // Digests taken in different modes are not compared with each other.
  std::vector<ReplicaDigest> sampled = same;
  for (auto& d : sampled) {
    d.sampled = true;
    d.digest += 100;
  }
  CHECK(ferry::compare_replica_digests({{0, &same}, {1, &sampled}}).ok());
}
