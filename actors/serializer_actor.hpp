// The serializer's interface: checksums and padding as the blocks stream
// from the snapshot to the writers.
#pragma once

#include <caf/all.hpp>

#include <vector>

#include "actors/context.hpp"
#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"
#include "actors/writer_actor.hpp"

namespace ferry {

// Extends block_return_actor so a writer can hand written blocks back.
using serializer_actor = block_return_actor::extend<
    // planner -> serializer: the files of a save; sent before the snapshot's.
    caf::reacts_to<atom::stream, StreamJob>,
    // planner -> serializer: the save's files, opened (when the job came
    // without them); blocks wait here until then.
    caf::reacts_to<atom::open, uint64_t, FileSet>,
    // snapshot -> serializer: a filled block, in file order.
    caf::reacts_to<atom::block, BlockMsg>,
    // serializer -> itself: hash the next block of save (deferred hashing).
    caf::reacts_to<atom::fill, uint64_t>,
    // planner -> serializer: stop the save; answered once no block of it
    // goes to a writer any more.
    caf::replies_to<atom::abandon, uint64_t>::with<bool>,
    // planner -> serializer: the writers from now on (one was retired);
    // sent before the next save's `stream`.
    caf::reacts_to<atom::writers, std::vector<writer_actor>>>;

// Linked to `parent` (the planner).
serializer_actor spawn_serializer(caf::local_actor* parent, ContextPtr ctx,
                                  std::vector<writer_actor> writers, planner_actor planner);

}  // namespace ferry
