// The snapshot's interface: copies the caller's tensors into staging blocks.
#pragma once

#include <caf/all.hpp>

#include "actors/context.hpp"
#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"
#include "actors/serializer_actor.hpp"

namespace ferry {

using snapshot_actor = caf::typed_actor<
    // planner -> snapshot: the files of a save to fill.
    caf::reacts_to<atom::stream, StreamJob>,
    // snapshot -> itself: issue the next block (one per message, so the
    // mailbox is served in between).
    caf::reacts_to<atom::fill, uint64_t>,
    // device callback -> snapshot: one copy of (save, block sequence) landed.
    caf::reacts_to<atom::copied, uint64_t, uint64_t, Status>,
    // pool release hook -> snapshot: a block is free again.
    caf::reacts_to<atom::freed>,
    // planner -> snapshot: stop the save; answered once no copy of it runs.
    caf::replies_to<atom::abandon, uint64_t>::with<bool>>;

// Linked to `parent` (the planner).
snapshot_actor spawn_snapshot(caf::local_actor* parent, ContextPtr ctx, serializer_actor serializer,
                              planner_actor planner);

}  // namespace ferry
