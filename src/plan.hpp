// Save planning, pure functions with no threads or I/O.
//
// A rank turns its state dict into a LocalPlan (one WriteItem per entry).
// The coordinator turns all ranks' local plans into a GlobalPlan: it validates
// them across ranks, groups identical items (same key, dtype, global shape and
// box) as replicas, picks who writes each replica group (possibly splitting a
// large one along dim 0 across the group), and assigns each chunk to a file of
// its writer. Byte offsets are not planned here: writers lay out their files
// (layout.hpp) and report offsets and checksums back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "box.hpp"
#include "ferry/save_plan.hpp"  // OwnerPolicy
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

struct WriteItem {
  std::string key;
  DType dtype = DType::f32;
  std::vector<int64_t> global_shape;
  Box box;              // the region of the global tensor this rank holds
  uint64_t nbytes = 0;  // box.numel() * dtype_size(dtype)
  uint32_t entry = 0;   // index of the entry in the rank's StateDict
};

struct LocalPlan {
  int32_t rank = 0;
  std::vector<WriteItem> items;
  // Stable 64-bit digest of everything but `entry` (what the coordinator
  // caches the global plan on).
  uint64_t digest() const;
};

// Validates every entry (names the key) and builds the rank's plan.
Result<LocalPlan> make_local_plan(const StateDict& sd, int32_t rank);
// The same, into `plan`, reusing its items' memory: a plan kept between
// saves of the same state is refilled without an allocation per item. On
// an error *plan is left half refilled. *unchanged (when given): the plan
// holds what it held before, so its digest() is the one it had.
Status make_local_plan_into(const StateDict& sd, int32_t rank, LocalPlan* plan,
                            bool* unchanged = nullptr);

struct GlobalPlanOptions {
  OwnerPolicy policy = OwnerPolicy::balanced;
  // A replicated item at least this large is split along dim 0 across its
  // replica group (balanced policy only). 0 disables splitting.
  uint64_t split_bytes = 64ull << 20;
  uint32_t files_per_rank = 1;
};

// One piece that a rank writes: all of an item, or a dim-0 slice of it.
struct ChunkAssignment {
  uint32_t item = 0;   // index into that rank's LocalPlan::items
  bool whole = false;  // the whole item: `box` is left empty (no allocation at 1000+ ranks)
  Box box;             // when !whole: a slice inside the item's box
  uint32_t file = 0;   // < RankPlan::files
};

// The region a chunk covers: the item's box when whole, else its slice.
inline const Box& chunk_box(const ChunkAssignment& a, const WriteItem& item) {
  return a.whole ? item.box : a.box;
}

struct RankPlan {
  int32_t rank = 0;
  uint32_t files = 1;
  std::vector<ChunkAssignment> chunks;  // in the order the rank writes them
  uint64_t bytes = 0;
  // Its items that other ranks hold too (indices into its LocalPlan::items,
  // ascending): every holder hashes them, so rank 0 can check they agree.
  std::vector<uint32_t> replicated;
};

struct GlobalPlan {
  std::vector<RankPlan> ranks;  // ranks[r].rank == r
  uint64_t total_bytes = 0;     // bytes written, each replica group once
  uint64_t unique_items = 0;    // replica groups
};

// `plans` holds one LocalPlan per rank, plans[r].rank == r. Errors
// (invalid_argument) name the key and the ranks: same key with different
// dtypes or global shapes, shards that overlap without being identical,
// shards that leave part of a tensor uncovered. O(n log n) in the total
// number of items for the usual row/column/grid shardings.
Result<GlobalPlan> make_global_plan(const std::vector<LocalPlan>& plans,
                                    const GlobalPlanOptions& opts = {});

}  // namespace ferry
