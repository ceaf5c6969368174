// The loader's interface: reads a load plan through detached readers.
#pragma once

#include <caf/all.hpp>

#include <functional>

#include "actors/context.hpp"
#include "actors/messages.hpp"

namespace ferry {

using reader_actor = caf::typed_actor<
    // loader -> reader: read, verify and copy one share of a load.
    caf::replies_to<atom::read, ReadTask>::with<Status>>;

using loader_actor = caf::typed_actor<
    // runtime -> loader: a whole load; answered with its first error or ok.
    caf::replies_to<atom::load, LoadJob>::with<Status>,
    // link -> loader: bytes another rank of this node read for a load (or
    // its failure); they may come before the load does.
    caf::reacts_to<atom::share, BlockShareMsg>,
    // loader -> itself: check that shared bytes still arrive.
    caf::reacts_to<atom::share_due, std::string>>;

loader_actor spawn_loader(caf::actor_system& sys, ContextPtr ctx);

// Test seam: `hook` runs on the loader's thread each time a frame of shared
// bytes passed its checksum, before its bytes go on into the tensors (the
// moment a sender writing into the share ring would do most harm). Null, the
// default, runs nothing; the caller keeps `hook` alive while it is set.
void set_share_checked_hook(const std::function<void()>* hook);

}  // namespace ferry
