// A load's wait for bytes other ranks of this node read for it: each frame checked and landed.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "actors/context.hpp"
#include "actors/messages.hpp"

namespace ferry {

// The pieces of one load that other ranks of this node read for this rank.
struct ShareWait {
  uint64_t task = 0;
  std::shared_ptr<const Manifest> manifest;
  LoadTargets targets;
  std::vector<std::pair<int32_t, ReadOp>> pieces;  // by (file, file_offset)
  std::map<int32_t, uint64_t> owed;                // bytes each reader has yet to send
  std::chrono::steady_clock::time_point last;      // when bytes last arrived
  std::shared_ptr<Transport> transport;            // acks go back on it
  std::shared_ptr<const ShareRing> ring;           // where ring frames' bytes lie
  std::shared_ptr<UnverifiedTensors> unverified;   // the load's
  // Ring frames are copied here before they are checked and used.
  std::unique_ptr<uint8_t[]> scratch;
  uint64_t scratch_bytes = 0;
};

// Checks one frame of shared bytes against its sum and copies it into the
// tensors of every piece it belongs to (in one pass where it goes to one
// stretch of one tensor). Errors name the sending rank.
Status take_share(const RankContext& ctx, ShareWait& w, const BlockShareMsg& msg);

}  // namespace ferry
