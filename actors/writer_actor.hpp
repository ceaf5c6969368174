// The writer's interface: blocking file I/O of a save, on its own thread.
#pragma once

#include <caf/all.hpp>

#include <memory>
#include <string>
#include <vector>

#include "actors/context.hpp"
#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"

namespace ferry {

using writer_actor = caf::typed_actor<
    // serializer -> writer: pwrite one block; the planner hears `written`.
    caf::reacts_to<atom::write, WriteBlock>,
    // planner -> writer: create the data files of a save, each allocated
    // to its size.
    caf::replies_to<atom::open, OpenFiles>::with<FileSet>,
    // planner -> writer: truncate to the size, fsync and close one file.
    caf::replies_to<atom::seal, std::shared_ptr<File>, uint64_t>::with<Status>,
    // planner -> writer after a failure: a barrier behind every queued block,
    caf::replies_to<atom::drain>::with<bool>,
    // then the close of the failed save's files.
    caf::replies_to<atom::close, std::vector<std::shared_ptr<File>>>::with<bool>,
    // planner -> writer: the caller's checkpoint_fn writes the rank's files,
    // made durable.
    caf::replies_to<atom::custom, CustomWrite>::with<CustomWritten>,
    // planner -> writer: compress a save's chunks from the caller's tensors.
    caf::replies_to<atom::compress, CompressJob>::with<CompressDone>>;

// Detached and linked to `parent` (the planner).
writer_actor spawn_writer(caf::local_actor* parent, ContextPtr ctx, planner_actor planner);

}  // namespace ferry
