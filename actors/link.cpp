// Link: the protocol end of this process. Frames arrive from the transport's
// progress thread as (frame, from, bytes) messages; requests from local actors
// leave as frames. A message that does not decode is logged and answered with
// an Abort naming the problem; a message for another job is logged and
// dropped.
//
// rank 0:   remote PlanRequest/CommitRequest/Abort/LoadRequest/LoadOutcome ->
//           coordinator, its answers -> the requesting rank; coordinator
//           aborts -> all ranks.
// rank > 0: planner/runtime requests -> rank 0, answers -> their promises;
//           rank 0 failing fails every pending request.

#include <cstdio>
#include <map>

#include "actors/actors.hpp"
#include "actors/messages.hpp"

namespace ferry {

namespace {

struct Pending {
  caf::response_promise promise;
  std::string phase;  // "plan", "commit", "load", "outcome"
};

struct link_state {
  static inline const char* name = "ferry.link";
  ContextPtr ctx;
  caf::actor coordinator;  // rank 0
  caf::actor planner;      // this rank's, for aborts
  std::shared_ptr<Transport> transport;
  std::map<std::string, Pending> pending;  // rank > 0: by "<phase>/<id>"
  Status rank0_failed;
  // Shutdown. Rank 0 serves the others' collective requests (a load, a
  // commit outcome), so it stays until every other rank left or failed.
  std::vector<bool> gone;  // rank 0: by rank
  std::vector<caf::response_promise> leave_waiters;
  bool leaving = false;  // rank > 0: we said goodbye
};

using link_ptr = caf::stateful_actor<link_state>*;

void log(const link_state& st, const std::string& what) {
  std::fprintf(stderr, "ferry[rank %d]: %s\n", st.ctx->rank, what.c_str());
}

void send_frame(link_ptr self, int32_t to, const WireMessage& m) {
  auto& st = self->state;
  if (!st.transport) return log(st, std::string("no transport to send ") + message_name(m));
  Status s = st.transport->send(to, encode_message(m));
  if (!s.ok())
    log(st, std::string("sending ") + message_name(m) + " to rank " + std::to_string(to) +
                " failed: " + s.to_string());
}

// rank > 0: forwards a request to rank 0 and parks its promise.
template <class Reply>
caf::result<Reply> forward(link_ptr self, const std::string& phase, const std::string& id,
                           const WireMessage& m, Reply on_failure, double timeout_s) {
  auto& st = self->state;
  if (!st.rank0_failed.ok()) return on_failure;
  auto rp = self->make_response_promise();
  st.pending[phase + "/" + id] = Pending{rp, phase};
  send_frame(self, 0, m);
  // A last resort: rank 0 enforces the phase timeouts and heartbeats catch a
  // hung rank 0, so this fires only if both failed to.
  self->delayed_send(self, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)),
                     atom::deadline_v, phase + "/" + id);
  return rp;
}

template <class Reply>
void complete(link_ptr self, const std::string& key, const Reply& r) {
  auto& st = self->state;
  auto it = st.pending.find(key);
  if (it == st.pending.end()) return log(st, "unexpected reply " + key);
  it->second.promise.deliver(r);
  st.pending.erase(it);
}

// rank > 0: what a pending request turns into when rank 0 is gone or silent.
void deliver_failure(const link_state& st, const std::string& key, Pending& p, const Status& why) {
  const std::string id = key.substr(key.find('/') + 1);
  if (p.phase == "plan") {
    p.promise.deliver(PlanReply{st.ctx->job_id, id, why, "", {}});
  } else if (p.phase == "commit") {
    // Our files were durable and rank 0 had everything it needed: it may or
    // may not have reached the commit point. The directory is the truth.
    p.promise.deliver(
        CommitMsg{st.ctx->job_id, id,
                  Status::outcome_unknown(why.message() + "; the checkpoint may or may not be "
                                                          "committed: check the root"),
                  "", 0});
  } else if (p.phase == "outcome") {
    // Without rank 0 no rank can know how the others' reads went.
    p.promise.deliver(LoadOutcomeMsg{st.ctx->job_id, id, st.ctx->rank, why, 0});
  } else {
    p.promise.deliver(LoadReplyMsg{st.ctx->job_id, id, why, "", ""});
  }
}

void fail_pending(link_ptr self, const Status& why) {
  auto& st = self->state;
  for (auto& [key, p] : st.pending) deliver_failure(st, key, p, why);
  st.pending.clear();
}

bool all_gone(const link_state& st) {
  for (size_t r = 1; r < st.gone.size(); ++r)
    if (!st.gone[r]) return false;
  return true;
}

void mark_gone(link_ptr self, int32_t rank) {
  auto& st = self->state;
  if (rank > 0 && static_cast<size_t>(rank) < st.gone.size()) st.gone[rank] = true;
  if (!all_gone(st)) return;
  for (auto& rp : st.leave_waiters) rp.deliver(true);
  st.leave_waiters.clear();
}

void on_remote(link_ptr self, int32_t from, WireMessage m) {
  auto& st = self->state;
  if (message_job_id(m) != st.ctx->job_id) {
    return log(st, std::string("dropped ") + message_name(m) + " from rank " +
                       std::to_string(from) + " of job '" + std::string(message_job_id(m)) +
                       "' (this is job '" + st.ctx->job_id + "')");
  }
  if (auto* hb = std::get_if<HeartbeatMsg>(&m)) {
    if (hb->leaving && st.ctx->rank == 0) mark_gone(self, from);
    return;
  }
  if (std::holds_alternative<JoinMsg>(m) || std::holds_alternative<JoinAckMsg>(m)) return;
  if (st.ctx->rank == 0) {
    if (auto* req = std::get_if<PlanRequest>(&m)) {
      if (req->rank != from) {
        send_frame(
            self, from,
            PlanReply{st.ctx->job_id,
                      req->checkpoint_id,
                      Status::invalid_argument("plan claims rank " + std::to_string(req->rank) +
                                               " but came from rank " + std::to_string(from)),
                      "",
                      {}});
        return;
      }
      self->request(st.coordinator, caf::infinite, atom::plan_v, std::move(*req))
          .then([self, from](const PlanReply& r) { send_frame(self, from, r); });
    } else if (auto* req = std::get_if<CommitRequest>(&m)) {
      req->result.rank = from;
      self->request(st.coordinator, caf::infinite, atom::commit_v, std::move(*req))
          .then([self, from](const CommitMsg& r) { send_frame(self, from, r); });
    } else if (auto* a = std::get_if<AbortMsg>(&m)) {
      self->send(st.coordinator, atom::abort_v, a->checkpoint_id, a->reason);
    } else if (auto* req = std::get_if<LoadRequestMsg>(&m)) {
      self->request(st.coordinator, caf::infinite, atom::load_v, std::move(*req))
          .then([self, from](const LoadReplyMsg& r) { send_frame(self, from, r); });
    } else if (auto* o = std::get_if<LoadOutcomeMsg>(&m)) {
      o->rank = from;  // the transport knows who sent it
      const std::string id = o->load_id;
      self->request(st.coordinator, caf::infinite, atom::outcome_v, std::move(*o))
          .then([self, from](const LoadOutcomeMsg& r) { send_frame(self, from, r); },
                [self, from, id](caf::error& e) {
                  auto& st = self->state;
                  send_frame(
                      self, from,
                      LoadOutcomeMsg{
                          st.ctx->job_id, id, st.ctx->rank,
                          Status::internal("rank 0 coordinator: " + self->system().render(e)), 0});
                });
    } else {
      log(st, std::string("unexpected ") + message_name(m) + " from rank " + std::to_string(from));
    }
    return;
  }
  if (auto* r = std::get_if<PlanReply>(&m)) {
    complete(self, "plan/" + r->checkpoint_id, *r);
  } else if (auto* r = std::get_if<CommitMsg>(&m)) {
    complete(self, "commit/" + r->checkpoint_id, *r);
  } else if (auto* r = std::get_if<LoadReplyMsg>(&m)) {
    complete(self, "load/" + r->load_id, *r);
  } else if (auto* r = std::get_if<LoadOutcomeMsg>(&m)) {
    complete(self, "outcome/" + r->load_id, *r);
  } else if (auto* a = std::get_if<AbortMsg>(&m)) {
    if (a->checkpoint_id.empty()) return log(st, "rank 0 reports: " + a->reason.to_string());
    self->send(st.planner, atom::abort_v, a->checkpoint_id, a->reason);
    for (const char* phase : {"plan/", "commit/"}) {
      auto it = st.pending.find(phase + a->checkpoint_id);
      if (it == st.pending.end()) continue;
      if (it->second.phase == "plan")
        it->second.promise.deliver(PlanReply{st.ctx->job_id, a->checkpoint_id, a->reason, "", {}});
      else
        it->second.promise.deliver(CommitMsg{st.ctx->job_id, a->checkpoint_id, a->reason, "", 0});
      st.pending.erase(it);
    }
  } else {
    log(st, std::string("unexpected ") + message_name(m) + " from rank " + std::to_string(from));
  }
}

caf::behavior link_actor(link_ptr self, ContextPtr ctx, caf::actor coordinator) {
  self->state.ctx = std::move(ctx);
  self->state.coordinator = std::move(coordinator);
  self->state.gone.assign(static_cast<size_t>(self->state.ctx->world_size), false);
  return {
      // Shutdown. Rank 0 answers once every other rank has left (or failed);
      // other ranks say goodbye first. Either way the answer comes after every
      // message already in the mailbox, so frames queued for other ranks reach
      // the transport before it stops.
      [self](atom::finish) -> caf::result<bool> {
        auto& st = self->state;
        if (st.ctx->rank != 0) {
          st.leaving = true;
          if (st.rank0_failed.ok())
            send_frame(self, 0, HeartbeatMsg{st.ctx->job_id, st.ctx->rank, 0, true});
          return true;
        }
        if (all_gone(st)) return true;
        auto rp = self->make_response_promise();
        st.leave_waiters.push_back(rp);
        return rp;
      },
      [self](atom::attach, std::shared_ptr<Transport> t, caf::actor planner) {
        self->state.transport = std::move(t);
        self->state.planner = std::move(planner);
      },
      [self](atom::frame, int32_t from, const std::string& bytes) {
        auto m = decode_message(bytes);
        if (!m.ok()) {
          auto& st = self->state;
          log(st, "malformed message from rank " + std::to_string(from) + ": " +
                      m.status().to_string());
          // Tell the sender; the empty checkpoint id makes it a report only.
          send_frame(self, from,
                     AbortMsg{st.ctx->job_id, "", st.ctx->rank, "",
                              m.status().with_context("rank " + std::to_string(st.ctx->rank) +
                                                      " could not decode a message: ")});
          return;
        }
        on_remote(self, from, std::move(m).value());
      },
      [self](atom::failed, int32_t rank, const Status& why) {
        auto& st = self->state;
        if (st.ctx->rank == 0) {
          const bool expected = static_cast<size_t>(rank) < st.gone.size() && st.gone[rank];
          if (expected) return;  // it said goodbye: closing is what it does next
          log(st, "rank " + std::to_string(rank) + " failed: " + why.to_string());
          self->send(st.coordinator, atom::failed_v, rank, why);
          mark_gone(self, rank);
          return;
        }
        if (st.leaving) return;
        log(st, "rank " + std::to_string(rank) + " failed: " + why.to_string());
        st.rank0_failed = Status::aborted("rank 0 (coordinator) failed: " + why.message());
        fail_pending(self, st.rank0_failed);
        self->send(st.planner, atom::abort_v, std::string("*"), st.rank0_failed);
      },
      // rank 0: the coordinator abandons a checkpoint; every rank hears it.
      [self](atom::abort, const AbortMsg& a) {
        auto& st = self->state;
        for (int32_t r = 1; r < st.ctx->world_size; ++r) send_frame(self, r, a);
        self->send(st.planner, atom::abort_v, a.checkpoint_id, a.reason);
      },
      // rank > 0: the coordinator's interface, over the wire.
      [self](atom::plan, PlanRequest& req) -> caf::result<PlanReply> {
        auto& st = self->state;
        const std::string id = req.checkpoint_id;
        PlanReply failure{st.ctx->job_id, id, st.rank0_failed, "", {}};
        return forward(self, "plan", id, WireMessage(std::move(req)), failure,
                       st.ctx->opts.plan_timeout_s + st.ctx->opts.heartbeat_timeout_s + 5);
      },
      [self](atom::commit, CommitRequest& req) -> caf::result<CommitMsg> {
        auto& st = self->state;
        const std::string id = req.checkpoint_id;
        CommitMsg failure{st.ctx->job_id, id, st.rank0_failed, "", 0};
        return forward(self, "commit", id, WireMessage(std::move(req)), failure,
                       st.ctx->opts.write_timeout_s + st.ctx->opts.commit_timeout_s +
                           st.ctx->opts.heartbeat_timeout_s + 5);
      },
      [self](atom::abort, const std::string& id, const Status& why) {
        auto& st = self->state;
        if (st.rank0_failed.ok())
          send_frame(self, 0, AbortMsg{st.ctx->job_id, id, st.ctx->rank, "", why});
      },
      [self](atom::load, LoadRequestMsg& req) -> caf::result<LoadReplyMsg> {
        auto& st = self->state;
        const std::string id = req.load_id;
        LoadReplyMsg failure{st.ctx->job_id, id, st.rank0_failed, "", ""};
        return forward(self, "load", id, WireMessage(std::move(req)), failure,
                       st.ctx->opts.commit_timeout_s + st.ctx->opts.heartbeat_timeout_s + 5);
      },
      // After its reads: this rank's outcome goes to rank 0, the load's comes back.
      [self](atom::outcome, LoadOutcomeMsg& report) -> caf::result<LoadOutcomeMsg> {
        auto& st = self->state;
        const std::string id = report.load_id;
        LoadOutcomeMsg failure{st.ctx->job_id, id, st.ctx->rank, st.rank0_failed, 0};
        return forward(self, "outcome", id, WireMessage(std::move(report)), failure,
                       st.ctx->opts.write_timeout_s + st.ctx->opts.heartbeat_timeout_s + 5);
      },
      [self](atom::deadline, const std::string& key) {
        auto& st = self->state;
        auto it = st.pending.find(key);
        if (it == st.pending.end()) return;
        Pending p = std::move(it->second);
        st.pending.erase(it);
        deliver_failure(st, key, p,
                        Status::timeout("no answer from rank 0 to the " + p.phase + " request"));
      },
  };
}

}  // namespace

caf::actor spawn_link(caf::actor_system& sys, ContextPtr ctx, caf::actor coordinator) {
  return sys.spawn(link_actor, std::move(ctx), std::move(coordinator));
}

}  // namespace ferry
