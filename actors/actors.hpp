// The actors of one rank and how they are started. Each is defined in its
// own source file; their messages are in messages.hpp.
//
//   save_async -> planner -> coordinator (rank 0) -> planner
//   planner -> snapshot -> serializer -> writer xN -> planner -> coordinator
//   load -> loader -> reader xN
#pragma once

#include <caf/all.hpp>

#include "actors/context.hpp"

namespace ferry {

// Rank 0 only: gathers local plans, builds the global plan, creates the
// pending directory, collects write results and commits. Detached: the commit
// protocol is blocking I/O.
caf::actor spawn_coordinator(caf::actor_system& sys, ContextPtr ctx);

// One per rank: drives each save; spawns (linked) its snapshot, serializer
// and writers.
caf::actor spawn_planner(caf::actor_system& sys, ContextPtr ctx, caf::actor coordinator);

// Spawned by the planner. After a failure the planner ends the save only
// once the snapshot has no copy running (it answers `abort` then) and the
// writers, which own the save's descriptors, have drained and closed them.
caf::actor spawn_snapshot(caf::local_actor* parent, ContextPtr ctx, caf::actor serializer,
                          caf::actor planner);
caf::actor spawn_serializer(caf::local_actor* parent, ContextPtr ctx,
                            std::vector<caf::actor> writers, caf::actor planner);
caf::actor spawn_writer(caf::local_actor* parent, ContextPtr ctx, caf::actor planner);

// The bridge between this process's actors and the other ranks: encodes and
// decodes the protocol (protocol.hpp) and drives the Transport. On rank 0 it
// forwards remote ranks' requests to the coordinator; on other ranks it
// stands in for the coordinator (the planner cannot tell the difference).
// Attach the transport with (atom::attach, shared_ptr<Transport>).
caf::actor spawn_link(caf::actor_system& sys, ContextPtr ctx, caf::actor coordinator);

// Load: the loader fans reads out to detached readers.
caf::actor spawn_loader(caf::actor_system& sys, ContextPtr ctx);

}  // namespace ferry
