// What every actor of one rank shares: the settings and the objects built
// once at start (filesystem, device, staging pool). Immutable after start,
// so it is handed around as shared_ptr<const RankContext>.
#pragma once

#include <memory>
#include <string>

#include "actors/share_window.hpp"
#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/options.hpp"
#include "pool.hpp"

namespace ferry {

struct RankContext {
  Options opts;
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string job_id;
  // The same on every rank of one job run, different across runs: with the
  // step and the save's sequence number it makes a checkpoint id all ranks
  // agree on without a round trip.
  uint64_t run_salt = 0;
  std::shared_ptr<Filesystem> fs;
  std::shared_ptr<DeviceBackend> device;
  std::shared_ptr<StagingPool> pool;
  // Flow control of the replicated bytes this rank sends others in a load:
  // readers wait in it, the link feeds it acks and failures.
  std::shared_ptr<ShareWindows> shares = std::make_shared<ShareWindows>();
};

using ContextPtr = std::shared_ptr<const RankContext>;

}  // namespace ferry
