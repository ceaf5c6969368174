// The coordinator's interface, shared with the link that stands in for it on
// ranks > 0 (coordinator_api), and the coordinator's own messages.
#pragma once

#include <caf/all.hpp>

#include <string>

#include "actors/context.hpp"
#include "actors/messages.hpp"

namespace ferry {

// What planners and the runtime ask of rank 0. The coordinator serves it on
// rank 0, the link on other ranks (over the wire): a planner cannot tell
// which one it holds.
using coordinator_api = caf::typed_actor<
    // A rank's local plan; the answer is its part of the global plan and the
    // pending directory (or why the checkpoint failed).
    caf::replies_to<atom::plan, PlanRequest>::with<PlanReply>,
    // A rank's write result; answered once the checkpoint committed or failed.
    caf::replies_to<atom::commit, CommitRequest>::with<CommitMsg>,
    // A rank abandons the checkpoint with this id, for this reason.
    caf::reacts_to<atom::abort_ckpt, std::string, Status>,
    // Which checkpoint a load means, and its manifest bytes.
    caf::replies_to<atom::resolve, LoadRequestMsg>::with<LoadReplyMsg>,
    // A rank's load outcome; the answer is the whole load's.
    caf::replies_to<atom::outcome, LoadOutcomeMsg>::with<LoadOutcomeMsg>>;

// What the coordinator needs of the link on rank 0: tell every rank that a
// checkpoint was abandoned.
using abort_broadcast_actor = caf::typed_actor<caf::reacts_to<atom::broadcast, AbortMsg>>;

using coordinator_actor = coordinator_api::extend<
    // runtime -> coordinator (world size > 1): the link on rank 0.
    caf::reacts_to<atom::attach_link, abort_broadcast_actor>,
    // link -> coordinator: this rank failed, for this reason.
    caf::reacts_to<atom::rank_failed, int32_t, Status>,
    // link -> coordinator: this failed rank rejoined; later checkpoints need it again.
    caf::reacts_to<atom::rank_rejoined, int32_t>,
    // coordinator -> itself: the deadline of (checkpoint, phase name) passed.
    caf::reacts_to<atom::ckpt_due, std::string, std::string>,
    // coordinator -> itself: the outcome wait of this load id ended.
    caf::reacts_to<atom::load_due, std::string>,
    // coordinator -> itself: refresh the lease of this checkpoint.
    caf::reacts_to<atom::lease, std::string>,
    // coordinator -> itself: remove this aborted pending directory again
    // (tries left), a rank may have been writing into it.
    caf::reacts_to<atom::sweep, std::string, int32_t>,
    // coordinator -> itself: delete the next file of a committed save's trash.
    caf::reacts_to<atom::tidy>>;

// Rank 0 only. Detached: the commit protocol is blocking I/O.
coordinator_actor spawn_coordinator(caf::actor_system& sys, ContextPtr ctx);

}  // namespace ferry
