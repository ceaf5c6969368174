// The link alone, on rank 1 of 2 with no transport: frames from rank 0 are
// fed in as the transport would, and a scoped actor plays this rank's
// planner. Toward the planner the link is a coordinator_api.

#include <catch2/catch.hpp>

#include <algorithm>
#include <mutex>

#include "actor_fixture.hpp"
#include "protocol.hpp"

namespace {

using ferry::Status;
using ferry::StatusCode;
using ferry::testing::Ask;

struct Link : ferry::testing::ActorSystem {
  std::shared_ptr<ferry::RankContext> ctx = ferry::testing::rank_context(1, 2);
  ferry::link_actor link;
  caf::scoped_actor planner{*sys};
  // The planner's view: it cannot tell the link from a coordinator.
  ferry::coordinator_api rank0;

  // A logger, when given, is in place before the link can log anything.
  explicit Link(ferry::Logger log = nullptr) {
    if (log) ctx->log = std::move(log);
    link = ferry::spawn_link(*sys, ctx, ferry::coordinator_actor());
    rank0 = link;
    caf::anon_send(link, ferry::atom::attach_net_v, std::shared_ptr<ferry::Transport>(),
                   caf::actor_cast<ferry::planner_actor>(planner.ptr()));
  }
  ~Link() {
    caf::anon_send_exit(link, caf::exit_reason::user_shutdown);
    link = nullptr;
    rank0 = nullptr;
  }

  void from_rank0(const ferry::WireMessage& m) {
    caf::anon_send(link, ferry::atom::frame_v, int32_t{0}, ferry::encode_message(m));
  }

  // The next abort the planner hears, with what it names.
  std::pair<std::string, Status> planner_heard() {
    std::pair<std::string, Status> out{"(nothing)", Status()};
    planner->receive(
        [&](ferry::atom::aborted, const std::string& id, const Status& why) {
          out = {id, why};
        },
        caf::after(std::chrono::seconds(10)) >> [] {});
    return out;
  }
};

ferry::PlanRequest plan(const std::string& id = "ckpt-1") {
  ferry::PlanRequest req;
  req.job_id = "job";
  req.checkpoint_id = id;
  req.rank = 1;
  req.step = 1;
  req.root = "/ckpt";
  req.plan.rank = 1;
  return req;
}

ferry::CommitRequest write_result(const std::string& id = "ckpt-1") {
  ferry::CommitRequest req;
  req.job_id = "job";
  req.checkpoint_id = id;
  req.result.rank = 1;
  return req;
}

}  // namespace

TEST_CASE("link alone: rank 0 failing fails every pending request, naming rank 0",
          "[link][actor]") {
  Link l;
  Ask<ferry::PlanReply> p(*l.sys, l.rank0, ferry::atom::plan_v, plan());
  Ask<ferry::CommitMsg> c(*l.sys, l.rank0, ferry::atom::commit_v, write_result("ckpt-0"));
  Ask<ferry::LoadReplyMsg> r(*l.sys, l.rank0, ferry::atom::resolve_v,
                             ferry::LoadRequestMsg{"job", "load-1", 1, "/ckpt"});
  Ask<ferry::LoadOutcomeMsg> o(*l.sys, l.rank0, ferry::atom::outcome_v,
                               ferry::LoadOutcomeMsg{"job", "load-0", 1, Status(), -1});
  caf::anon_send(l.link, ferry::atom::peer_failed_v, int32_t{0},
                 Status::io_error("connection lost"));

  const Status& ps = p.answer().status;
  CHECK(ps.code() == StatusCode::aborted);
  CHECK_THAT(ps.message(),
             Catch::Contains("rank 0 (coordinator) failed") && Catch::Contains("connection lost"));
  // The files were durable: whether rank 0 committed is unknown, not failed.
  const Status& cs = c.answer().status;
  CHECK(cs.code() == StatusCode::outcome_unknown);
  CHECK_THAT(cs.message(),
             Catch::Contains("rank 0 (coordinator) failed") && Catch::Contains("check the root"));
  CHECK_THAT(r.answer().status.message(), Catch::Contains("rank 0 (coordinator) failed"));
  CHECK(r.answer().load_id == "load-1");
  CHECK_THAT(o.answer().status.message(), Catch::Contains("rank 0 (coordinator) failed"));

  const auto [id, why] = l.planner_heard();
  CHECK(id == "*");
  CHECK_THAT(why.message(), Catch::Contains("rank 0 (coordinator) failed"));

  // Later requests fail at once.
  Ask<ferry::PlanReply> later(*l.sys, l.rank0, ferry::atom::plan_v, plan("ckpt-2"));
  CHECK_THAT(later.answer().status.message(), Catch::Contains("rank 0 (coordinator) failed"));
}

TEST_CASE("link alone: rank 0's answers reach the requests they answer", "[link][actor]") {
  Link l;
  Ask<ferry::PlanReply> p1(*l.sys, l.rank0, ferry::atom::plan_v, plan("ckpt-1"));
  Ask<ferry::CommitMsg> c1(*l.sys, l.rank0, ferry::atom::commit_v, write_result("ckpt-1"));
  Ask<ferry::LoadReplyMsg> r(*l.sys, l.rank0, ferry::atom::resolve_v,
                             ferry::LoadRequestMsg{"job", "load-1", 1, "/ckpt"});
  l.from_rank0(ferry::LoadReplyMsg{"job", "load-1", Status(), "/ckpt/step-1", "bytes"});
  l.from_rank0(ferry::CommitMsg{"job", "ckpt-1", Status(), "/ckpt/step-1", 3});
  l.from_rank0(ferry::PlanReply{"job", "ckpt-1", Status(), "/ckpt/pending", {}});
  CHECK(p1.answer().pending_dir == "/ckpt/pending");
  CHECK(c1.answer().path == "/ckpt/step-1");
  CHECK(c1.answer().commit_seq == 3);
  CHECK(r.answer().manifest == "bytes");
}

TEST_CASE(
    "link alone: an abort from rank 0 ends that checkpoint's requests and reaches the planner",
    "[link][actor]") {
  Link l;
  Ask<ferry::PlanReply> p(*l.sys, l.rank0, ferry::atom::plan_v, plan("ckpt-1"));
  const Status why = Status::aborted("rank 2 failed during the plan phase: connection lost");
  l.from_rank0(ferry::AbortMsg{"job", "ckpt-1", 2, "plan", why});
  CHECK(p.answer().status.message() == why.message());
  const auto [id, heard] = l.planner_heard();
  CHECK(id == "ckpt-1");
  CHECK(heard.message() == why.message());
}

TEST_CASE("link alone: a request rank 0 never answers times out, naming rank 0 and the request",
          "[link][actor]") {
  Link l;
  Ask<ferry::PlanReply> p(*l.sys, l.rank0, ferry::atom::plan_v, plan("ckpt-1"));
  Ask<ferry::LoadOutcomeMsg> o(*l.sys, l.rank0, ferry::atom::outcome_v,
                               ferry::LoadOutcomeMsg{"job", "load-1", 1, Status(), -1});
  // The last-resort deadlines, due now (their timers are tens of seconds).
  caf::anon_send(l.link, ferry::atom::reply_due_v, ferry::RemoteRequest::plan,
                 std::string("ckpt-1"));
  caf::anon_send(l.link, ferry::atom::reply_due_v, ferry::RemoteRequest::outcome,
                 std::string("load-1"));
  CHECK(p.answer().status.code() == StatusCode::timeout);
  CHECK(p.answer().status.message() == "no answer from rank 0 to the plan request");
  CHECK(o.answer().status.message() == "no answer from rank 0 to the outcome request");
}

TEST_CASE("link alone: leaving makes a later failure of rank 0 expected", "[link][actor]") {
  Link l;
  caf::scoped_actor self{*l.sys};
  bool left = false;
  self->request(l.link, std::chrono::seconds(10), ferry::atom::leave_v)
      .receive([&](bool ok) { left = ok; }, [](caf::error&) {});
  CHECK(left);
  caf::anon_send(l.link, ferry::atom::peer_failed_v, int32_t{0}, Status::io_error("closed"));
  // Not an abort: the planner hears nothing.
  bool heard = false;
  l.planner->receive([&](ferry::atom::aborted, const std::string&, const Status&) { heard = true; },
                     caf::after(std::chrono::milliseconds(200)) >> [] {});
  CHECK_FALSE(heard);
}

TEST_CASE("link alone: forged or stray ShareAcks are dropped, the true one opens the window",
          "[link][actor][flow]") {
  Link l;
  ferry::ShareWindows& w = *l.ctx->shares;
  constexpr uint64_t kWindow = 1000;
  w.open(1, "load-1", {0});
  REQUIRE(w.acquire("load-1", 0, kWindow, kWindow, 30).ok());
  using ferry::ShareAckMsg;
  l.from_rank0(ShareAckMsg{"other-job", "load-1", 0, 1, 500, Status()});  // another job
  l.from_rank0(ShareAckMsg{"job", "load-7", 0, 1, 500, Status()});        // a load not sending
  l.from_rank0(ShareAckMsg{"job", "load-1", 0, 1, 5000, Status()});       // more than was sent
  l.from_rank0(ShareAckMsg{"job", "load-1", 0, 9, 500, Status()});        // for a rank not here
  caf::anon_send(l.link, ferry::atom::frame_v, int32_t{0}, std::string("FRY1 garbage"));
  l.from_rank0(ShareAckMsg{"job", "load-1", 0, 1, 400, Status()});
  // Only the last ack makes room for 400 bytes: the wait ends on it, and
  // none of the others took anything off the window.
  REQUIRE(w.acquire("load-1", 0, 400, kWindow, 30).ok());
  CHECK(w.outstanding("load-1", 0) == kWindow);
  w.close("load-1", Status());
}

TEST_CASE("link alone: rank 0's loss is logged once, not again when the transport gives it up",
          "[link][actor][rejoin]") {
  auto lines = std::make_shared<std::vector<std::string>>();
  auto mu = std::make_shared<std::mutex>();
  auto count = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(*mu);
    return std::count_if(lines->begin(), lines->end(),
                         [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };
  Link l([lines, mu](ferry::LogLevel, const std::string& m) {
    std::lock_guard<std::mutex> lock(*mu);
    lines->push_back(m);
  });
  caf::anon_send(l.link, ferry::atom::peer_failed_v, int32_t{0},
                 Status::io_error("heartbeat timeout"));
  CHECK(l.planner_heard().first == "*");
  // The transport's give-up, after asking rank 0 back in vain: it logs that
  // line itself.
  caf::anon_send(l.link, ferry::atom::peer_failed_v, int32_t{0},
                 Status::aborted("rank 0 lost: this rank asked it back and gave up"));
  CHECK(l.planner_heard().first == "*");
  CHECK(count("heartbeat timeout") == 1);
  CHECK(count("gave up") == 0);
  // Back, then lost again: a new loss, logged again.
  caf::anon_send(l.link, ferry::atom::peer_rejoined_v, int32_t{0});
  caf::anon_send(l.link, ferry::atom::peer_failed_v, int32_t{0}, Status::io_error("reset"));
  CHECK(l.planner_heard().first == "*");
  CHECK(count("rank 0 is back") == 1);
  CHECK(count("reset") == 1);
}
