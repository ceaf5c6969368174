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
// Shared load bytes (BlockShare, ShareAck) go straight between the ranks of a
// node over the transport's direct lanes; where there is none, rank 0 passes
// them on (relay), counting them. A rank told by rank 0 that another failed
// closes its lane to it.
//
//   rank > 0: up --peer_failed(0)--> rank 0 failed (requests fail at once, naming rank 0)
//              <--peer_rejoined(0)--+ (the transport asks rank 0 again until it is back)
//              +---leave---> leaving (a failure of rank 0 is expected now, not reported)
//   rank 0:   serving --leave--> waiting until every other rank left or failed --> done
//
// Toward the planner and the runtime the link is a coordinator_api: on
// ranks > 0 it answers the coordinator's requests with rank 0's answers.

#include <cstdio>
#include <map>

#include "actors/link_actor.hpp"
#include "actors/messages.hpp"
#include "frame_buffers.hpp"

namespace ferry {

namespace {

// rank > 0: requests forwarded to rank 0 and not yet answered, one map per
// kind of request, by checkpoint or load id.
template <class Reply>
using Waiting = std::map<std::string, caf::typed_response_promise<Reply>>;

struct link_state {
  static inline const char* name = "ferry.link";
  ContextPtr ctx;
  coordinator_actor coordinator;  // rank 0
  planner_actor planner;          // this rank's, for aborts
  loader_actor loader;            // this rank's, for bytes other ranks share
  std::shared_ptr<Transport> transport;
  Waiting<PlanReply> plans;
  Waiting<CommitMsg> commits;
  Waiting<LoadReplyMsg> resolves;
  Waiting<LoadOutcomeMsg> outcomes;
  Status rank0_failed;
  // Shutdown. Rank 0 serves the others' collective requests (a load, a
  // commit outcome), so it stays until every other rank left or failed.
  std::vector<bool> gone;  // rank 0: by rank
  std::vector<bool> left;  // rank 0: said goodbye (gone for good; never rejoins)
  std::vector<caf::typed_response_promise<bool>> leave_waiters;
  bool leaving = false;  // rank > 0: we said goodbye
};

using link_ptr = link_actor::stateful_pointer<link_state>;

void log(const link_state& st, const std::string& what) {
  log_printf(st.ctx->log, LogLevel::warning, "ferry[rank %d]: %s", st.ctx->rank, what.c_str());
}

// The name a request has in logs and errors.
const char* request_name(RemoteRequest r) {
  switch (r) {
    case RemoteRequest::plan:
      return "plan";
    case RemoteRequest::commit:
      return "commit";
    case RemoteRequest::resolve:
      return "load";
    case RemoteRequest::outcome:
      return "outcome";
  }
  return "?";
}

void send_frame(link_ptr self, int32_t to, const WireMessage& m) {
  auto& st = self->state;
  if (!st.transport) return log(st, std::string("no transport to send ") + message_name(m));
  Status s = st.transport->send(to, encode_message(m, st.ctx->frames.get()));
  if (!s.ok())
    log(st, std::string("sending ") + message_name(m) + " to rank " + std::to_string(to) +
                " failed: " + s.to_string());
}

// rank > 0: forwards a request to rank 0 and parks its promise.
template <class Reply>
caf::result<Reply> forward(link_ptr self, Waiting<Reply>& waiting, RemoteRequest kind,
                           const std::string& id, const WireMessage& m, Reply on_failure,
                           double timeout_s) {
  auto& st = self->state;
  if (!st.rank0_failed.ok()) return on_failure;
  auto rp = self->make_response_promise<Reply>();
  waiting[id] = rp;
  send_frame(self, 0, m);
  // A last resort: rank 0 enforces the phase timeouts and heartbeats catch a
  // hung rank 0, so this fires only if both failed to.
  self->delayed_send(link_actor{self},
                     std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)),
                     atom::reply_due_v, kind, id);
  return rp;
}

template <class Reply>
void complete(link_ptr self, Waiting<Reply>& waiting, RemoteRequest kind, const std::string& id,
              const Reply& r) {
  auto it = waiting.find(id);
  if (it == waiting.end())
    return log(self->state, std::string("unexpected reply ") + request_name(kind) + "/" + id);
  it->second.deliver(r);
  waiting.erase(it);
}

// rank > 0: what a pending request turns into when rank 0 is gone or silent.
void deliver_failure(const link_state& st, const std::string& id,
                     caf::typed_response_promise<PlanReply>& p, const Status& why) {
  p.deliver(PlanReply{st.ctx->job_id, id, why, "", {}});
}

void deliver_failure(const link_state& st, const std::string& id,
                     caf::typed_response_promise<CommitMsg>& p, const Status& why) {
  // Our files were durable and rank 0 had everything it needed: it may or
  // may not have reached the commit point. The directory is the truth.
  p.deliver(CommitMsg{st.ctx->job_id, id,
                      Status::outcome_unknown("commit phase: " + why.message() +
                                              "; the checkpoint may or may not be "
                                              "committed: check the root"),
                      "", 0});
}

void deliver_failure(const link_state& st, const std::string& id,
                     caf::typed_response_promise<LoadReplyMsg>& p, const Status& why) {
  p.deliver(LoadReplyMsg{st.ctx->job_id, id, why, "", ""});
}

void deliver_failure(const link_state& st, const std::string& id,
                     caf::typed_response_promise<LoadOutcomeMsg>& p, const Status& why) {
  // Without rank 0 no rank can know how the others' reads went.
  p.deliver(LoadOutcomeMsg{st.ctx->job_id, id, st.ctx->rank, why, 0});
}

template <class Reply>
void fail_all(const link_state& st, Waiting<Reply>& waiting, const Status& why) {
  for (auto& [id, p] : waiting) deliver_failure(st, id, p, why);
  waiting.clear();
}

void fail_pending(link_ptr self, const Status& why) {
  auto& st = self->state;
  fail_all(st, st.plans, why);
  fail_all(st, st.commits, why);
  fail_all(st, st.resolves, why);
  fail_all(st, st.outcomes, why);
}

// rank > 0: the last-resort deadline of one forwarded request passed.
template <class Reply>
void expire(link_state& st, Waiting<Reply>& waiting, RemoteRequest kind, const std::string& id) {
  auto it = waiting.find(id);
  if (it == waiting.end()) return;
  auto p = std::move(it->second);
  waiting.erase(it);
  deliver_failure(st, id, p,
                  Status::timeout(std::string("no answer from rank 0 to the ") +
                                  request_name(kind) + " request"));
}

// rank 0: a remote rank's request, answered by the coordinator; an error of
// the coordinator itself reaches the rank as the request's failure.
template <class Reply, class Request, class Atom>
void ask_coordinator(link_ptr self, int32_t from, Atom what, Request req, Reply on_error) {
  auto& st = self->state;
  self->request(st.coordinator, caf::infinite, what, std::move(req))
      .then([self, from](const Reply& r) { send_frame(self, from, r); },
            [self, from, on_error](caf::error& e) mutable {
              on_error.status = Status::internal("rank 0 coordinator: " + self->system().render(e));
              send_frame(self, from, on_error);
            });
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

// A rank failed: loads waiting for bytes it reads for others fail now,
// naming it, here and (rank 0 tells them) on every other rank.
void shared_reader_failed(link_ptr self, int32_t rank, const Status& why) {
  auto& st = self->state;
  const Status reason =
      Status::aborted("rank " + std::to_string(rank) + " failed: " + why.message());
  BlockShareMsg m{st.ctx->job_id, kAnyLoad, rank, st.ctx->rank, 0, 0, reason, ""};
  // Readers here waiting for room toward it stop; on a rank > 0 every
  // window needs rank 0 (its load cannot complete without it).
  st.ctx->shares->fail_rank(rank, reason, st.ctx->rank != 0 && rank == 0);
  if (st.loader) self->send(st.loader, atom::share_v, m);
  if (st.ctx->rank != 0) return;
  for (int32_t r = 1; r < st.ctx->world_size; ++r) {
    if (r == rank || st.gone[r]) continue;
    m.to = r;
    send_frame(self, r, m);
  }
}

// Rank 0 passes a frame it checked on to `to` as it came: encoding it
// again would cost another copy of up to a window of bytes.
// The frame moves on: what of `m` views it (a BlockShare's data) is not read after.
void relay(link_ptr self, int32_t to, const WireMessage& m, std::string& raw) {
  auto& st = self->state;
  if (!st.transport) return log(st, std::string("no transport to send ") + message_name(m));
  st.ctx->shares->count_relayed();
  Status s = st.transport->send(to, std::move(raw));
  if (!s.ok())
    log(st, std::string("passing ") + message_name(m) + " on to rank " + std::to_string(to) +
                " failed: " + s.to_string());
}

// A frame that came over a direct lane (from a rank > 0 to a rank > 0): the
// transport vouches for the sender, so it must speak for itself, and only
// rank 0 reports failures.
bool lane_frame_ok(const link_state& st, int32_t from, int32_t claims, const std::string& load,
                   const char* what) {
  if (st.ctx->rank == 0 || from == 0) return true;
  if (claims == from && load != kAnyLoad) return true;
  log(st, std::string("dropped ") + what + " from rank " + std::to_string(from) +
              " claiming rank " + std::to_string(claims) +
              (load == kAnyLoad ? " reporting a failure" : ""));
  return false;
}

// Bytes one rank read for another of its node. Rank 0 forwards what is for
// another rank (those without a direct lane between them); only rank 0 may
// speak for others.
void on_share(link_ptr self, int32_t from, BlockShareMsg share, const WireMessage& m,
              std::string& raw) {
  auto& st = self->state;
  if (st.ctx->rank == 0 && share.from != from)
    return log(st, "dropped BlockShare claiming rank " + std::to_string(share.from) +
                       " from rank " + std::to_string(from));
  if (!lane_frame_ok(st, from, share.from, share.load_id, "BlockShare")) return;
  if (share.to != st.ctx->rank) {
    if (st.ctx->rank != 0 || share.to >= st.ctx->world_size)
      return log(st, "dropped BlockShare for rank " + std::to_string(share.to) + " from rank " +
                         std::to_string(from));
    return relay(self, share.to, m, raw);
  }
  if (!st.loader) return log(st, "no loader for a BlockShare from rank " + std::to_string(from));
  // Rank 0 reports a failed rank to the others: readers here stop sending to
  // it, and its lane closes (UCX would not notice a dead peer on it).
  if (share.load_id == kAnyLoad && st.ctx->rank != 0) {
    st.ctx->shares->fail_rank(share.from, share.status);
    if (st.transport) st.transport->close_lane(share.from, share.status);
  }
  self->send(st.loader, atom::share_v, std::move(share));
}

// A receiver of shared bytes acknowledges them to their sender (flow
// control). Rank 0 forwards what is for another rank, as it does BlockShare.
void on_share_ack(link_ptr self, int32_t from, const ShareAckMsg& ack, const WireMessage& m,
                  std::string& raw) {
  auto& st = self->state;
  const std::string what = "ShareAck from rank " + std::to_string(from);
  if (st.ctx->rank == 0 && ack.from != from)
    return log(st, "dropped " + what + " claiming rank " + std::to_string(ack.from));
  if (!lane_frame_ok(st, from, ack.from, ack.load_id, "ShareAck")) return;
  if (ack.to != st.ctx->rank) {
    if (st.ctx->rank != 0 || ack.to >= st.ctx->world_size)
      return log(st, "dropped " + what + " for rank " + std::to_string(ack.to));
    return relay(self, ack.to, m, raw);
  }
  Status s = st.ctx->shares->ack(ack.load_id, ack.from, ack.bytes, ack.status);
  if (!s.ok()) log(st, "dropped " + what + ": " + s.message());
}

// `raw` is the frame `m` came in, for rank 0 to pass on unchanged.
void on_remote(link_ptr self, int32_t from, WireMessage m, std::string& raw) {
  auto& st = self->state;
  if (message_job_id(m) != st.ctx->job_id) {
    return log(st, std::string("dropped ") + message_name(m) + " from rank " +
                       std::to_string(from) + " of job '" + std::string(message_job_id(m)) +
                       "' (this is job '" + st.ctx->job_id + "')");
  }
  if (auto* hb = std::get_if<HeartbeatMsg>(&m)) {
    if (hb->leaving && st.ctx->rank == 0 && !st.gone[from]) {
      // Its runtime shut down after its last save ended: a checkpoint or load
      // that still needs it can never complete, so the others hear it now
      // rather than at a timeout.
      const Status why =
          Status::aborted("rank " + std::to_string(from) + " left the job (its runtime shut down)");
      self->send(st.coordinator, atom::rank_failed_v, from, why);
      shared_reader_failed(self, from, why);
      st.left[from] = true;
      mark_gone(self, from);
    }
    return;
  }
  if (std::holds_alternative<JoinMsg>(m) || std::holds_alternative<JoinAckMsg>(m)) return;
  if (auto* share = std::get_if<BlockShareMsg>(&m))
    return on_share(self, from, std::move(*share), m, raw);
  if (auto* ack = std::get_if<ShareAckMsg>(&m)) return on_share_ack(self, from, *ack, m, raw);
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
      const std::string id = req->checkpoint_id;
      ask_coordinator(self, from, atom::plan_v, std::move(*req),
                      PlanReply{st.ctx->job_id, id, Status(), "", {}});
    } else if (auto* req = std::get_if<CommitRequest>(&m)) {
      req->result.rank = from;
      const std::string id = req->checkpoint_id;
      ask_coordinator(self, from, atom::commit_v, std::move(*req),
                      CommitMsg{st.ctx->job_id, id, Status(), "", 0});
    } else if (auto* a = std::get_if<AbortMsg>(&m)) {
      self->send(st.coordinator, atom::abort_ckpt_v, a->checkpoint_id, a->reason);
    } else if (auto* req = std::get_if<LoadRequestMsg>(&m)) {
      const std::string id = req->load_id;
      ask_coordinator(self, from, atom::resolve_v, std::move(*req),
                      LoadReplyMsg{st.ctx->job_id, id, Status(), "", ""});
    } else if (auto* o = std::get_if<LoadOutcomeMsg>(&m)) {
      o->rank = from;  // the transport knows who sent it
      const std::string id = o->load_id;
      ask_coordinator(self, from, atom::outcome_v, std::move(*o),
                      LoadOutcomeMsg{st.ctx->job_id, id, st.ctx->rank, Status(), 0});
    } else {
      log(st, std::string("unexpected ") + message_name(m) + " from rank " + std::to_string(from));
    }
    return;
  }
  if (auto* r = std::get_if<PlanReply>(&m)) {
    complete(self, st.plans, RemoteRequest::plan, r->checkpoint_id, *r);
  } else if (auto* r = std::get_if<CommitMsg>(&m)) {
    complete(self, st.commits, RemoteRequest::commit, r->checkpoint_id, *r);
  } else if (auto* r = std::get_if<LoadReplyMsg>(&m)) {
    complete(self, st.resolves, RemoteRequest::resolve, r->load_id, *r);
  } else if (auto* r = std::get_if<LoadOutcomeMsg>(&m)) {
    complete(self, st.outcomes, RemoteRequest::outcome, r->load_id, *r);
  } else if (auto* a = std::get_if<AbortMsg>(&m)) {
    if (a->checkpoint_id.empty()) return log(st, "rank 0 reports: " + a->reason.to_string());
    self->send(st.planner, atom::aborted_v, a->checkpoint_id, a->reason);
    if (auto it = st.plans.find(a->checkpoint_id); it != st.plans.end()) {
      it->second.deliver(PlanReply{st.ctx->job_id, a->checkpoint_id, a->reason, "", {}});
      st.plans.erase(it);
    }
    if (auto it = st.commits.find(a->checkpoint_id); it != st.commits.end()) {
      it->second.deliver(CommitMsg{st.ctx->job_id, a->checkpoint_id, a->reason, "", 0});
      st.commits.erase(it);
    }
  } else {
    log(st, std::string("unexpected ") + message_name(m) + " from rank " + std::to_string(from));
  }
}

link_actor::behavior_type link_fun(link_ptr self, ContextPtr ctx, coordinator_actor coordinator) {
  self->state.ctx = std::move(ctx);
  self->state.coordinator = std::move(coordinator);
  self->state.gone.assign(static_cast<size_t>(self->state.ctx->world_size), false);
  self->state.left.assign(static_cast<size_t>(self->state.ctx->world_size), false);
  return {
      // Shutdown. Rank 0 answers once every other rank has left (or failed);
      // other ranks say goodbye first. Either way the answer comes after every
      // message already in the mailbox, so frames queued for other ranks reach
      // the transport before it stops.
      [self](atom::leave) -> caf::result<bool> {
        auto& st = self->state;
        if (st.ctx->rank != 0) {
          st.leaving = true;
          if (st.rank0_failed.ok())
            send_frame(self, 0, HeartbeatMsg{st.ctx->job_id, st.ctx->rank, 0, true});
          return true;
        }
        if (all_gone(st)) return true;
        auto rp = self->make_response_promise<bool>();
        st.leave_waiters.push_back(rp);
        return rp;
      },
      [self](atom::attach_net, std::shared_ptr<Transport> t, planner_actor planner) {
        self->state.transport = std::move(t);
        self->state.planner = std::move(planner);
      },
      [self](atom::attach_loader, loader_actor loader) { self->state.loader = std::move(loader); },
      [self](atom::frame, int32_t from, std::string& bytes) {
        // Shared: a BlockShare's data stays in the frame it came in, and the
        // frame's buffer serves a later one once the loader is done with it.
        auto frame = frame_owner(std::move(bytes), self->state.ctx->frames);
        auto m = decode_message(std::shared_ptr<const std::string>(frame));
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
        on_remote(self, from, std::move(m).value(), *frame);
      },
      [self](atom::peer_failed, int32_t rank, const Status& why) {
        auto& st = self->state;
        if (st.ctx->rank == 0) {
          const bool expected = static_cast<size_t>(rank) < st.gone.size() && st.gone[rank];
          if (expected) return;  // it said goodbye: closing is what it does next
          log(st, "rank " + std::to_string(rank) + " failed: " + why.to_string());
          self->send(st.coordinator, atom::rank_failed_v, rank, why);
          shared_reader_failed(self, rank, why);
          mark_gone(self, rank);
          return;
        }
        if (st.leaving) return;
        // A second failure without a rejoin between is the transport giving
        // rank 0 up after asking it back: the transport said so already.
        if (st.rank0_failed.ok()) log(st, "rank 0 failed: " + why.to_string());
        st.rank0_failed = Status::aborted("rank 0 (coordinator) failed: " + why.message());
        fail_pending(self, st.rank0_failed);
        shared_reader_failed(self, 0, why);
        self->send(st.planner, atom::aborted_v, std::string("*"), st.rank0_failed);
      },
      // A failed rank is back with a new session (after a partition): what
      // it failed stays failed; later requests and checkpoints include it.
      [self](atom::peer_rejoined, int32_t rank) {
        auto& st = self->state;
        if (st.ctx->rank == 0) {
          if (rank <= 0 || static_cast<size_t>(rank) >= st.gone.size() || st.left[rank]) return;
          log(st, "rank " + std::to_string(rank) + " rejoined");
          st.gone[rank] = false;
          st.ctx->shares->rejoined(rank);
          self->send(st.coordinator, atom::rank_rejoined_v, rank);
          return;
        }
        if (st.leaving || rank != 0) return;
        log(st, "rank 0 is back: requests go to it again");
        st.rank0_failed = Status();
        st.ctx->shares->rejoined(0);
      },
      // rank 0: the coordinator abandons a checkpoint; every rank hears it.
      [self](atom::broadcast, const AbortMsg& a) {
        auto& st = self->state;
        for (int32_t r = 1; r < st.ctx->world_size; ++r) send_frame(self, r, a);
        self->send(st.planner, atom::aborted_v, a.checkpoint_id, a.reason);
      },
      // rank > 0: the coordinator's interface, over the wire.
      [self](atom::plan, PlanRequest& req) -> caf::result<PlanReply> {
        auto& st = self->state;
        const std::string id = req.checkpoint_id;
        PlanReply failure{st.ctx->job_id, id, st.rank0_failed, "", {}};
        return forward(self, st.plans, RemoteRequest::plan, id, WireMessage(std::move(req)),
                       failure, st.ctx->opts.plan_timeout_s + st.ctx->opts.heartbeat_timeout_s + 5);
      },
      [self](atom::commit, CommitRequest& req) -> caf::result<CommitMsg> {
        auto& st = self->state;
        const std::string id = req.checkpoint_id;
        CommitMsg failure{st.ctx->job_id, id, st.rank0_failed, "", 0};
        return forward(self, st.commits, RemoteRequest::commit, id, WireMessage(std::move(req)),
                       failure,
                       st.ctx->opts.write_timeout_s + st.ctx->opts.commit_timeout_s +
                           st.ctx->opts.heartbeat_timeout_s + 5);
      },
      [self](atom::abort_ckpt, const std::string& id, const Status& why) {
        auto& st = self->state;
        if (st.rank0_failed.ok())
          send_frame(self, 0, AbortMsg{st.ctx->job_id, id, st.ctx->rank, "", why});
      },
      [self](atom::resolve, LoadRequestMsg& req) -> caf::result<LoadReplyMsg> {
        auto& st = self->state;
        const std::string id = req.load_id;
        LoadReplyMsg failure{st.ctx->job_id, id, st.rank0_failed, "", ""};
        return forward(self, st.resolves, RemoteRequest::resolve, id, WireMessage(std::move(req)),
                       failure,
                       st.ctx->opts.commit_timeout_s + st.ctx->opts.heartbeat_timeout_s + 5);
      },
      // After its reads: this rank's outcome goes to rank 0, the load's comes back.
      [self](atom::outcome, LoadOutcomeMsg& report) -> caf::result<LoadOutcomeMsg> {
        auto& st = self->state;
        const std::string id = report.load_id;
        LoadOutcomeMsg failure{st.ctx->job_id, id, st.ctx->rank, st.rank0_failed, 0};
        return forward(self, st.outcomes, RemoteRequest::outcome, id,
                       WireMessage(std::move(report)), failure,
                       st.ctx->opts.write_timeout_s + st.ctx->opts.heartbeat_timeout_s + 5);
      },
      [self](atom::reply_due, RemoteRequest kind, const std::string& id) {
        auto& st = self->state;
        switch (kind) {
          case RemoteRequest::plan:
            return expire(st, st.plans, kind, id);
          case RemoteRequest::commit:
            return expire(st, st.commits, kind, id);
          case RemoteRequest::resolve:
            return expire(st, st.resolves, kind, id);
          case RemoteRequest::outcome:
            return expire(st, st.outcomes, kind, id);
        }
      },
  };
}

}  // namespace

link_actor spawn_link(caf::actor_system& sys, ContextPtr ctx, coordinator_actor coordinator) {
  return sys.spawn(link_fun, std::move(ctx), std::move(coordinator));
}

}  // namespace ferry
