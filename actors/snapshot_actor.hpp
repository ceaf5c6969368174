// The snapshot's interfaces: the snapshot copies the caller's tensors into
// staging blocks; it has one helper actor per GPU in use, which hands that
// GPU's copies to the device backend.
#pragma once

#include <caf/all.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/context.hpp"
#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"
#include "actors/serializer_actor.hpp"

CAF_ADD_ATOM(ferry, ferry::atom, gpu_copy, "gpucopy")
CAF_ADD_ATOM(ferry, ferry::atom, gpu_issued, "gpuissued")

namespace ferry {

using snapshot_actor = caf::typed_actor<
    // planner -> snapshot: the files of a save to fill.
    caf::reacts_to<atom::stream, StreamJob>,
    // snapshot -> itself: issue the next few blocks (a few per message, so
    // the mailbox is served in between).
    caf::reacts_to<atom::fill, uint64_t>,
    // copy lane or GPU snapshot -> snapshot: the copies of (save, block
    // sequence) on one device landed, with the first error.
    caf::reacts_to<atom::copied, uint64_t, uint64_t, Status>,
    // pool release hook -> snapshot: a block is free again.
    caf::reacts_to<atom::freed>,
    // planner -> snapshot: stop the save; answered once no copy of it runs.
    caf::replies_to<atom::abandon, uint64_t>::with<bool>>;

// One copy of a block: bytes [src_off, src_off + len) of `*view` to `dst`.
// `view` and `key` (the tensor, for errors) point into the save's sources and
// layouts, which the block's BlockCopies keeps alive: a copy of each per
// tensor cost allocations that, at 100,000 small tensors, weighed on the
// snapshot as much as the bytes did.
struct BlockCopy {
  const TensorView* view = nullptr;
  uint64_t src_off = 0;
  uint64_t len = 0;
  uint8_t* dst = nullptr;
  const std::string* key = nullptr;
};

// The copies of one block on one device: `copied` goes to the snapshot once,
// when the last of them completed, with the first error. Thread-safe. Holds
// the save's `sources` and `layouts` (what the copies point into) until then.
class BlockCopies {
 public:
  BlockCopies(snapshot_actor to, uint64_t save, uint64_t seq, size_t n,
              std::shared_ptr<const void> sources, std::shared_ptr<const void> layouts)
      : to_(std::move(to)),
        save_(save),
        seq_(seq),
        left_(n),
        sources_(std::move(sources)),
        layouts_(std::move(layouts)) {}
  void done(Status s) {
    // Only an error takes the lock: a block of small tensors has hundreds
    // of copies.
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_.ok()) status_ = std::move(s);
    }
    // acq_rel: the last one sees every error stored before a fetch_sub.
    if (left_.fetch_sub(1, std::memory_order_acq_rel) == 1)
      caf::anon_send(to_, atom::copied_v, save_, seq_, status_);
  }

 private:
  snapshot_actor to_;
  uint64_t save_, seq_;
  std::atomic<size_t> left_;
  std::shared_ptr<const void> sources_, layouts_;
  std::mutex mu_;
  Status status_;
};

// snapshot -> GPU snapshot: the copies of one block on that GPU.
struct GpuCopies {
  std::vector<BlockCopy> copies;
  std::shared_ptr<BlockCopies> done;
  std::shared_ptr<const std::atomic<bool>> cancelled;  // the save was abandoned
};

// Counts down the devices that still hand on copies of a save; the last one
// tells the save that every copy is queued with its device.
struct IssuedMark {
  std::shared_ptr<std::atomic<size_t>> left;
  std::shared_ptr<detail::SaveState> state;
  void arrive() const {
    if (left->fetch_sub(1) == 1) state->mark_copies_issued();
  }
};

using gpu_snapshot_actor = caf::typed_actor<
    // snapshot -> GPU snapshot: hand these copies to the device backend.
    caf::reacts_to<atom::gpu_copy, GpuCopies>,
    // snapshot -> GPU snapshot: the save's last copies were sent before this.
    caf::reacts_to<atom::gpu_issued, IssuedMark>>;

// Linked to `parent` (the planner).
snapshot_actor spawn_snapshot(caf::local_actor* parent, ContextPtr ctx, serializer_actor serializer,
                              planner_actor planner);

}  // namespace ferry

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::GpuCopies)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::IssuedMark)
