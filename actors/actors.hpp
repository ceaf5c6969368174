// The actors of one rank: an index of their interfaces, one header each.
//
//   save_async -> planner -> coordinator_api (rank 0: coordinator; else: link) -> planner
//   planner -> snapshot -> serializer -> writer xN -> planner -> coordinator_api
//   load -> coordinator_api (resolve) -> loader -> reader xN -> coordinator_api (outcome)
//
// docs/protocol.md ("Actors") has the table of each actor's messages in and out.
#pragma once

#include "actors/coordinator_actor.hpp"
#include "actors/link_actor.hpp"
#include "actors/loader_actor.hpp"
#include "actors/planner_actor.hpp"
#include "actors/serializer_actor.hpp"
#include "actors/snapshot_actor.hpp"
#include "actors/writer_actor.hpp"
