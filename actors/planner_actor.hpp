// The planner's interface: one per rank, drives each save.
#pragma once

#include <caf/all.hpp>

#include <string>

#include "actors/context.hpp"
#include "actors/coordinator_actor.hpp"
#include "actors/messages.hpp"

namespace ferry {

using planner_actor = caf::typed_actor<
    // runtime -> planner: a save to queue.
    caf::reacts_to<atom::save, SaveJob>,
    // snapshot -> planner: the snapshot of save `id` ended with the status.
    caf::reacts_to<atom::snapped, uint64_t, Status>,
    // writer -> planner: (save, file, bytes) written, or the write's error.
    caf::reacts_to<atom::written, uint64_t, uint32_t, uint64_t, Status>,
    // serializer -> planner: the checksums of a save.
    caf::reacts_to<atom::sums, ChecksumSet>,
    // coordinator (rank 0) or link -> planner: the checkpoint with this id
    // ("*": every one, rank 0 is gone) was abandoned.
    caf::reacts_to<atom::aborted, std::string, Status>,
    // planner -> itself: the deadline of (save, phase name) passed.
    caf::reacts_to<atom::phase_due, uint64_t, std::string>,
    // SavePlanner -> planner: the next step of a save driven in steps.
    caf::reacts_to<atom::proceed, Proceed>>;

// `coordinator` is the coordinator on rank 0 and the link on other ranks:
// the planner sees only their shared interface.
planner_actor spawn_planner(caf::actor_system& sys, ContextPtr ctx, coordinator_api coordinator);

}  // namespace ferry
