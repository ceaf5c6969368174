// Replica checks, pure logic: every holder of a replicated item (one written
// once for several ranks) hashes its bytes, and rank 0 compares the holders'
// digests before the commit, so a value that differs by rank under one key
// fails the save instead of being saved as one rank's value.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "commit.hpp"
#include "ferry/device.hpp"
#include "ferry/options.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

// What an item of `nbytes` gets under the configured mode: full, sampled or
// off (auto resolved by kReplicaCheckFullBytes).
ReplicaCheck replica_mode(ReplicaCheck configured, uint64_t nbytes);

// The byte ranges [offset, length) a mode hashes: all of them, or 64
// windows of 4 KiB spread evenly from the first byte to the last.
std::vector<std::pair<uint64_t, uint64_t>> replica_ranges(ReplicaCheck mode, uint64_t nbytes);

// xxh3-64 of the view's row-major bytes in `mode`'s ranges (and the byte
// count). Host contiguous views are hashed in place; device or strided ones
// through `device` into a bounded buffer. REQUIRES: mode is full or sampled.
Result<uint64_t> replica_digest(DeviceBackend& device, const TensorView& view, ReplicaCheck mode);

// One rank's digests, as its write result carried them.
struct RankDigests {
  int32_t rank = 0;
  const std::vector<ReplicaDigest>* digests = nullptr;
};

// ok when the holders of each replicated item agree. Otherwise
// invalid_argument naming the first key (in key order) whose holders
// disagree, and which ranks hold which value. Digests of the same item in
// different modes (sampled and full) are not compared.
Status compare_replica_digests(const std::vector<RankDigests>& ranks);

}  // namespace ferry
