// The coordinator alone, through coordinator_actor's messages: a scoped
// actor plays the ranks' planners and, where it matters, rank 0's link.

#include <catch2/catch.hpp>

#include <filesystem>

#include "actor_fixture.hpp"
#include "catalog.hpp"
#include "test_util.hpp"

namespace {

using ferry::Status;
using ferry::StatusCode;
using ferry::testing::Ask;
using ferry::testing::TempDir;

struct Coordinator : ferry::testing::ActorSystem {
  std::shared_ptr<ferry::RankContext> ctx;
  ferry::coordinator_actor coordinator;

  explicit Coordinator(int32_t world, double plan_timeout_s = 30) {
    ctx = ferry::testing::rank_context(0, world);
    ctx->opts.plan_timeout_s = plan_timeout_s;
    coordinator = ferry::spawn_coordinator(*sys, ctx);
  }
  ~Coordinator() {
    caf::anon_send_exit(coordinator, caf::exit_reason::user_shutdown);
    coordinator = nullptr;
  }
};

ferry::PlanRequest plan(int32_t rank, const std::string& root, uint64_t step = 1,
                        const std::string& id = "ckpt-1") {
  ferry::PlanRequest req;
  req.job_id = "job";
  req.checkpoint_id = id;
  req.rank = rank;
  req.step = step;
  req.root = root;
  req.plan.rank = rank;
  return req;
}

ferry::CommitRequest write_result(int32_t rank, const std::string& id = "ckpt-1") {
  ferry::CommitRequest req;
  req.job_id = "job";
  req.checkpoint_id = id;
  req.result.rank = rank;
  return req;
}

}  // namespace

TEST_CASE("coordinator alone: plan, then commit, with one rank", "[coordinator][actor]") {
  TempDir d;
  Coordinator c(1);
  Ask<ferry::PlanReply> p(*c.sys, c.coordinator, ferry::atom::plan_v, plan(0, d.path()));
  const auto& reply = p.answer();
  REQUIRE(reply.status.ok());
  CHECK(std::filesystem::is_directory(reply.pending_dir));
  Ask<ferry::CommitMsg> commit(*c.sys, c.coordinator, ferry::atom::commit_v, write_result(0));
  const auto& done = commit.answer();
  REQUIRE(done.status.ok());
  CHECK(std::filesystem::exists(done.path + "/" + ferry::kManifestFileName));
  CHECK_FALSE(std::filesystem::exists(reply.pending_dir));
}

TEST_CASE("coordinator alone: ranks that disagree on the step fail the checkpoint, naming both",
          "[coordinator][actor]") {
  TempDir d;
  Coordinator c(2);
  // The scoped actor stands in for rank 0's link: it hears the broadcast.
  caf::scoped_actor link{*c.sys};
  caf::anon_send(c.coordinator, ferry::atom::attach_link_v,
                 caf::actor_cast<ferry::abort_broadcast_actor>(link.ptr()));
  Ask<ferry::PlanReply> r0(*c.sys, c.coordinator, ferry::atom::plan_v, plan(0, d.path(), 1));
  Ask<ferry::PlanReply> r1(*c.sys, c.coordinator, ferry::atom::plan_v, plan(1, d.path(), 2));
  for (auto* r : {&r0, &r1}) {
    const Status& s = r->answer().status;
    CHECK(s.code() == StatusCode::invalid_argument);
    CHECK_THAT(s.message(), Catch::Contains("step") && Catch::Contains("rank 0 has 1") &&
                                Catch::Contains("rank 1 has 2"));
  }
  bool heard = false;
  link->receive(
      [&](ferry::atom::broadcast, const ferry::AbortMsg& a) {
        heard = true;
        CHECK(a.checkpoint_id == "ckpt-1");
        CHECK(a.failed_rank == 1);
        CHECK(a.phase == "plan");
      },
      caf::after(std::chrono::seconds(10)) >> [] {});
  CHECK(heard);
  // A rank whose plan comes late gets the same error at once.
  Ask<ferry::PlanReply> late(*c.sys, c.coordinator, ferry::atom::plan_v, plan(1, d.path(), 2));
  CHECK(late.answer().status.code() == StatusCode::invalid_argument);
}

TEST_CASE("coordinator alone: a rank that fails ends the plan phase, naming rank and phase",
          "[coordinator][actor]") {
  TempDir d;
  Coordinator c(3);
  Ask<ferry::PlanReply> r0(*c.sys, c.coordinator, ferry::atom::plan_v, plan(0, d.path()));
  caf::anon_send(c.coordinator, ferry::atom::rank_failed_v, int32_t{2},
                 Status::io_error("connection lost"));
  const Status& s = r0.answer().status;
  CHECK(s.code() == StatusCode::aborted);
  CHECK_THAT(s.message(), Catch::Contains("rank 2 failed during the plan phase") &&
                              Catch::Contains("connection lost"));
  // Later checkpoints fail at once: the rank stays failed.
  Ask<ferry::PlanReply> next(*c.sys, c.coordinator, ferry::atom::plan_v,
                             plan(0, d.path(), 2, "ckpt-2"));
  CHECK_THAT(next.answer().status.message(), Catch::Contains("rank 2 failed before the plan"));
}

TEST_CASE("coordinator alone: the plan phase times out naming the missing ranks",
          "[coordinator][actor]") {
  TempDir d;
  Coordinator c(3, 0.2);
  Ask<ferry::PlanReply> r1(*c.sys, c.coordinator, ferry::atom::plan_v, plan(1, d.path()));
  const Status& s = r1.answer().status;
  CHECK(s.code() == StatusCode::timeout);
  CHECK_THAT(s.message(),
             Catch::Contains("rank 1 is saving step 1; ranks 0, 2 have not called save within "
                             "plan-timeout (0.2 s): every rank calls save_async with its own "
                             "shards, even for replicated state"));
}

TEST_CASE("coordinator alone: replicas whose digests differ fail the commit, naming key and ranks",
          "[coordinator][actor][replica]") {
  TempDir d;
  Coordinator c(3);
  std::vector<std::unique_ptr<Ask<ferry::PlanReply>>> plans;
  for (int32_t r = 0; r < 3; ++r)
    plans.push_back(std::make_unique<Ask<ferry::PlanReply>>(
        *c.sys, c.coordinator, ferry::atom::plan_v, plan(r, d.path())));
  for (auto& p : plans) REQUIRE(p->answer().status.ok());
  std::vector<std::unique_ptr<Ask<ferry::CommitMsg>>> commits;
  for (int32_t r = 0; r < 3; ++r) {
    ferry::CommitRequest req = write_result(r);
    // Two replicated items: "step" agrees everywhere, "rng" differs on rank 2.
    req.result.replica_digests = {{"step", {}, 77, false}, {"rng", {0}, r == 2 ? 2u : 1u, false}};
    commits.push_back(
        std::make_unique<Ask<ferry::CommitMsg>>(*c.sys, c.coordinator, ferry::atom::commit_v, req));
  }
  for (auto& cm : commits) {
    const Status& s = cm->answer().status;
    CHECK(s.code() == StatusCode::invalid_argument);
    CHECK_THAT(s.message(), Catch::Contains("tensor 'rng'") &&
                                Catch::Contains("ranks 0, 1 hold one value, rank 2 another"));
  }
  CHECK(ferry::list_checkpoints(*ferry::posix_filesystem(), d.path())->empty());
}

TEST_CASE("coordinator alone: a rank's abort reaches the others, and a commit of it is refused",
          "[coordinator][actor]") {
  TempDir d;
  Coordinator c(2);
  Ask<ferry::PlanReply> r0(*c.sys, c.coordinator, ferry::atom::plan_v, plan(0, d.path()));
  caf::anon_send(c.coordinator, ferry::atom::abort_ckpt_v, std::string("ckpt-1"),
                 Status::io_error("rank 1 (write phase): disk full"));
  CHECK_THAT(r0.answer().status.message(), Catch::Contains("rank 1 (write phase): disk full"));
  // Refused with the abort's cause, as the others heard it.
  Ask<ferry::CommitMsg> commit(*c.sys, c.coordinator, ferry::atom::commit_v, write_result(0));
  CHECK_FALSE(commit.answer().status.ok());
  CHECK_THAT(commit.answer().status.message(), Catch::Contains("rank 1 (write phase): disk full"));
}

TEST_CASE("coordinator alone: resolving a load under an empty root names the root",
          "[coordinator][actor]") {
  TempDir d;
  Coordinator c(1);
  Ask<ferry::LoadReplyMsg> r(*c.sys, c.coordinator, ferry::atom::resolve_v,
                             ferry::LoadRequestMsg{"job", "load-1", 0, d.path()});
  CHECK_FALSE(r.answer().status.ok());
  CHECK_THAT(r.answer().status.message(), Catch::Contains(d.path()));
}
