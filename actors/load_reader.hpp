// The reader actor's state and behavior, for the loader that spawns it (load_reader.cpp).
#pragma once

#include "actors/context.hpp"
#include "actors/loader_actor.hpp"

namespace ferry {

struct reader_state {
  static inline const char* name = "ferry.reader";
  ContextPtr ctx;
};

// Reads, verifies and copies one task's part of a load, and sends shared bytes on.
reader_actor::behavior_type reader_fun(reader_actor::stateful_pointer<reader_state> self,
                                       ContextPtr ctx);

}  // namespace ferry
