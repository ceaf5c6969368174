// One actor tested alone through its typed interface: an actor system, a
// rank's context, and requests whose answers are read later.
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "actors/actors.hpp"
#include "ferry/filesystem.hpp"

namespace ferry::testing {

struct ActorSystem {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;

  ActorSystem() {
    cfg.set("logger.console-verbosity", caf::atom("quiet"));
    sys = std::make_unique<caf::actor_system>(cfg);
  }
};

inline std::shared_ptr<RankContext> rank_context(int32_t rank, int32_t world) {
  auto ctx = std::make_shared<RankContext>();
  ctx->rank = rank;
  ctx->world_size = world;
  ctx->job_id = "job";
  ctx->fs = posix_filesystem();
  ctx->opts.fsync = false;
  return ctx;
}

// One request, sent at once; its answer read later. Each has its own scoped
// actor, so the answers of several open requests never mix.
template <class Reply>
class Ask {
 public:
  template <class Dest, class... Ts>
  Ask(caf::actor_system& sys, const Dest& dest, Ts&&... xs) : self_(sys) {
    wait_ = [this, h = self_->request(dest, std::chrono::seconds(30),
                                      std::forward<Ts>(xs)...)]() mutable {
      h.receive([this](const Reply& r) { reply_ = r; },
                [this](caf::error& e) { error_ = self_->system().render(e); });
    };
  }
  Ask(const Ask&) = delete;
  Ask& operator=(const Ask&) = delete;

  const Reply& answer() {
    if (!reply_ && error_.empty()) wait_();
    INFO("the request failed: " << error_);
    REQUIRE(reply_.has_value());
    return *reply_;
  }

 private:
  caf::scoped_actor self_;
  std::function<void()> wait_;
  std::optional<Reply> reply_;
  std::string error_;
};

}  // namespace ferry::testing
