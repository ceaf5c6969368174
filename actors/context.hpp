// What every actor of one rank shares: the settings and the objects built
// once at start (filesystem, device, staging pool). Immutable after start,
// so it is handed around as shared_ptr<const RankContext>.
#pragma once

#include <memory>
#include <string>

#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/options.hpp"
#include "ferry/pool.hpp"

namespace ferry {

struct RankContext {
  Options opts;
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string job_id;
  std::shared_ptr<Filesystem> fs;
  std::shared_ptr<DeviceBackend> device;
  std::shared_ptr<StagingPool> pool;
};

using ContextPtr = std::shared_ptr<const RankContext>;

}  // namespace ferry
