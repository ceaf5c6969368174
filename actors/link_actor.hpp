// The link's interface: the coordinator's (coordinator_api), which it serves
// over the wire on ranks > 0, plus what the transport and the runtime tell it.
#pragma once

#include <caf/all.hpp>

#include <memory>
#include <string>

#include "actors/context.hpp"
#include "actors/coordinator_actor.hpp"
#include "actors/loader_actor.hpp"
#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"
#include "actors/transport.hpp"

namespace ferry {

// The requests a rank > 0 forwards to rank 0 and awaits an answer to.
enum class RemoteRequest { plan, commit, resolve, outcome };

using link_actor = coordinator_api::extend<
    // coordinator -> link (rank 0): a checkpoint was abandoned; every rank hears it.
    caf::reacts_to<atom::broadcast, AbortMsg>,
    // runtime -> link: the started transport, and this rank's planner (for aborts).
    caf::reacts_to<atom::attach_net, std::shared_ptr<Transport>, planner_actor>,
    // runtime -> link: this rank's loader, which takes the bytes other ranks share.
    caf::reacts_to<atom::attach_loader, loader_actor>,
    // transport -> link: one frame from a rank.
    caf::reacts_to<atom::frame, int32_t, std::string>,
    // transport -> link: a rank failed or went silent.
    caf::reacts_to<atom::peer_failed, int32_t, Status>,
    // transport -> link: a failed rank is back (rank 0 on ranks > 0).
    caf::reacts_to<atom::peer_rejoined, int32_t>,
    // link -> itself (rank > 0): the last-resort deadline of a forwarded request.
    caf::reacts_to<atom::reply_due, RemoteRequest, std::string>,
    // runtime -> link at shutdown: answered once it may stop the transport.
    caf::replies_to<atom::leave>::with<bool>>;

// World size > 1. `coordinator` is rank 0's (null elsewhere).
link_actor spawn_link(caf::actor_system& sys, ContextPtr ctx, coordinator_actor coordinator);

}  // namespace ferry

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::RemoteRequest)
