// The coordinator's side of a collective load, through its messages: it
// answers every rank with the same outcome, the first error naming its rank.
// In-process, but here because only this target sees the actors' internals.

#include <catch2/catch.hpp>

#include <chrono>
#include <optional>

#include "actors/actors.hpp"
#include "actors/messages.hpp"
#include "ferry/filesystem.hpp"

namespace {

using ferry::LoadOutcomeMsg;
using ferry::Status;
using ferry::StatusCode;

struct Coordinator {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  ferry::coordinator_actor coordinator;

  Coordinator(int32_t world, double write_timeout_s) {
    auto ctx = std::make_shared<ferry::RankContext>();
    ctx->world_size = world;
    ctx->job_id = "job";
    ctx->opts.write_timeout_s = write_timeout_s;
    ctx->fs = ferry::posix_filesystem();
    cfg.set("logger.console-verbosity", caf::atom("quiet"));
    sys = std::make_unique<caf::actor_system>(cfg);
    coordinator = ferry::spawn_coordinator(*sys, ctx);
  }
  ~Coordinator() {
    caf::anon_send_exit(coordinator, caf::exit_reason::user_shutdown);
    coordinator = nullptr;
  }
};

// One rank's report, sent at once; its answer read later.
struct Report {
  caf::scoped_actor self;
  using Handle = decltype(std::declval<caf::scoped_actor&>()->request(
      std::declval<ferry::coordinator_actor&>(), std::chrono::seconds(10), ferry::atom::outcome_v,
      std::declval<LoadOutcomeMsg>()));
  std::optional<Handle> handle;

  Report(Coordinator& c, int32_t rank, Status status, const std::string& id = "load-1")
      : self(*c.sys) {
    handle.emplace(self->request(c.coordinator, std::chrono::seconds(10), ferry::atom::outcome_v,
                                 LoadOutcomeMsg{"job", id, rank, std::move(status), -1}));
  }
  LoadOutcomeMsg answer() {
    LoadOutcomeMsg out;
    handle->receive([&](const LoadOutcomeMsg& m) { out = m; },
                    [&](caf::error& e) {
                      out.status = Status::internal(self->system().render(e));
                      out.failed_rank = -2;
                    });
    return out;
  }
};

}  // namespace

TEST_CASE("every rank gets the first error, naming the rank it came from", "[coordinator][load]") {
  Coordinator c(3, 30);
  const Status bad = Status::corruption("checksum mismatch in tensor 'w' of file rank-00002-0000");
  Report r0(c, 0, Status()), r2(c, 2, bad), r1(c, 1, Status());
  for (Report* r : {&r0, &r1, &r2}) {
    const LoadOutcomeMsg a = r->answer();
    CHECK(a.status.code() == StatusCode::corruption);
    CHECK(a.status.message() == "rank 2: " + bad.message());
    CHECK(a.failed_rank == 2);
  }
  Report late(c, 1, Status());  // a repeated report gets the same answer
  CHECK(late.answer().failed_rank == 2);
}

TEST_CASE("success only once every rank succeeded", "[coordinator][load]") {
  Coordinator c(2, 30);
  Report r1(c, 1, Status()), r0(c, 0, Status());
  for (Report* r : {&r0, &r1}) {
    const LoadOutcomeMsg a = r->answer();
    CHECK(a.status.ok());
    CHECK(a.failed_rank == -1);
  }
}

TEST_CASE("an error every rank reported alike is passed on unprefixed", "[coordinator][load]") {
  Coordinator c(2, 30);
  const Status none = Status::not_found("no committed checkpoint under /ckpt");
  Report r0(c, 0, none), r1(c, 1, none);
  for (Report* r : {&r0, &r1}) CHECK(r->answer().status.message() == none.message());
}

TEST_CASE("a rank that never reports ends the load at write-timeout, naming it",
          "[coordinator][load]") {
  Coordinator c(3, 0.2);
  Report r0(c, 0, Status()), r2(c, 2, Status());
  for (Report* r : {&r0, &r2}) {
    const LoadOutcomeMsg a = r->answer();
    CHECK(a.status.code() == StatusCode::timeout);
    CHECK_THAT(a.status.message(), Catch::Contains("rank(s) 1"));
    CHECK(a.failed_rank == 1);
  }
  Report late(c, 1, Status());
  CHECK(late.answer().status.code() == StatusCode::timeout);
}

TEST_CASE("a reported error is the answer even when the wait ends at the timeout",
          "[coordinator][load]") {
  Coordinator c(3, 0.2);
  const Status bad = Status::invalid_argument("key 'emb' not in the checkpoint");
  Report r1(c, 1, bad), r0(c, 0, Status());
  for (Report* r : {&r0, &r1}) {
    const LoadOutcomeMsg a = r->answer();
    CHECK(a.status.message() == "rank 1: " + bad.message());
    CHECK(a.failed_rank == 1);
  }
}

TEST_CASE("a rank that fails ends the wait for its outcome, naming it", "[coordinator][load]") {
  Coordinator c(2, 30);
  Report r0(c, 0, Status());
  caf::anon_send(c.coordinator, ferry::atom::rank_failed_v, int32_t{1},
                 Status::io_error("connection lost"));
  const LoadOutcomeMsg a = r0.answer();
  CHECK(a.status.code() == StatusCode::aborted);
  CHECK_THAT(a.status.message(),
             Catch::Contains("rank 1 failed") && Catch::Contains("connection lost"));
  CHECK(a.failed_rank == 1);
  // Later loads fail at once: the rank stays failed.
  Report next(c, 0, Status(), "load-2");
  CHECK(next.answer().failed_rank == 1);
}
