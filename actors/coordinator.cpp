// Coordinator: the rank-0 role that turns the ranks' local plans into one
// checkpoint. Detached, because creating the pending directory and the
// commit protocol are blocking I/O.
//
//   idle --first plan--> planning --all local plans--> writing --all write results--> commit -->
//   idle
//                           |                             |                             |
//                           +------- abort_ckpt ----------+-----------------------------+--> idle
//                                   (pending directory removed once created)
//
// planning: every later PlanRequest of the checkpoint must agree with the
//           first on root, step and overwrite; a rank that disagrees aborts
//           the checkpoint at once, naming the field, the values and the ranks.
// writing:  the lease of the pending directory is refreshed; a refresh that
//           fails aborts (gc may take a directory whose lease lapsed).
// commit:   commit_checkpoint, which refuses a lease that is not ours any
//           more; failures after the commit point are warnings of a
//           committed save, logged here once and sent to every rank.
//           What retention (or an overwrite) moved to trash is deleted
//           after the ranks have their answer, a file per message (tidy),
//           so a save never waits for it and plans and loads are served
//           in between; the next save's gc deletes what is left before its
//           files take space, and so does the exit of the runtime.
// Each phase has its deadline (plan-timeout, write-timeout; the commit is
// one blocking call here, so commit-timeout is enforced where the ranks wait
// for it, by their planners). An aborted checkpoint's error is kept for a
// while, so a rank whose plan comes late gets it at once.
//
// The pending directory's name carries a nonce drawn here: a job restarted
// with the same token has the same checkpoint ids, and must never meet (let
// alone remove) a pending directory of its predecessor.
//
// The global plan is cached and reused while the ranks' local plans have the
// same digests.

#include <cstdio>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "actors/coordinator_actor.hpp"
#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"
#include "catalog.hpp"
#include "manifest_check.hpp"
#include "planner_api.hpp"
#include "replica_check.hpp"

namespace ferry {

namespace {

// idle is no active checkpoint; the commit is one blocking call, no phase.
enum class Phase { planning, writing };

struct Checkpoint {
  std::string id;
  int32_t first_rank = 0;  // whose PlanRequest set step, root and overwrite
  uint64_t step = 0;
  std::string root;
  std::string pending_dir;
  std::string lease_owner;
  bool overwrite = false;
  bool want_all = false;     // a rank drives the save in steps and shows every rank's plan
  uint8_t owner_policy = 0;  // as PlanRequest: 0 is the configured one
  std::vector<std::pair<std::string, std::string>> metadata;
  // Dropped once the global plan is made: an in-process planner refills
  // its plan in place only when no one else holds it.
  std::vector<std::shared_ptr<const LocalPlan>> plans;
  std::vector<bool> planned;  // by rank: its plan came
  // By rank: the plan's digest when its planner sent it along (0: unknown),
  // and whether the plan came in process (its reply then shares the plan).
  std::vector<uint64_t> digests;
  std::vector<bool> in_process;
  std::vector<DataFileOptions> files;  // by rank: how each names and fills its data files
  std::vector<caf::typed_response_promise<PlanReply>> plan_promises;
  size_t plans_in = 0;
  Phase phase = Phase::planning;
  std::vector<std::optional<WriteResult>> results;
  std::vector<caf::typed_response_promise<CommitMsg>> commit_promises;
  size_t results_in = 0;
  std::vector<RankTrace> traces;  // trace-dir set: by rank, as their write results brought them
};

// One collective load's outcomes as the ranks report them, until rank 0
// answers them all.
struct LoadOutcomes {
  std::vector<std::optional<Status>> status;  // by rank
  std::vector<caf::typed_response_promise<LoadOutcomeMsg>> promises;
  size_t in = 0;
  std::vector<RankNeeds> needs;   // the needs round: what each rank reported it reads
  std::vector<RankTrace> traces;  // trace-dir set: the ranks' phases, as their reports brought them
};

// A collective load as the first rank that asked for it named it.
struct ResolvedLoad {
  LoadReplyMsg reply;
  int32_t rank = 0;
  std::string path;
};

struct coordinator_state {
  static inline const char* name = "ferry.coordinator";
  ContextPtr ctx;
  abort_broadcast_actor link;  // world size > 1: broadcasts aborts to every rank
  planner_actor planner;       // world size 1: the only rank's planner, told of aborts directly
  // Ranks that failed, with why: every later checkpoint fails at once
  // instead of waiting for them to the plan timeout.
  std::map<int32_t, Status> failed;
  // Loads resolved for the ranks, by load id: every rank of one collective
  // load gets the same directory and manifest bytes.
  std::map<std::string, ResolvedLoad> loads;
  std::deque<std::string> load_order;
  std::optional<Checkpoint> active;
  // Recently aborted checkpoints and why, for ranks whose plan comes later.
  std::map<std::string, Status> aborted;
  std::deque<std::string> aborted_order;
  std::mt19937_64 nonces{std::random_device{}()};
  std::vector<uint64_t> cached_digests;
  std::shared_ptr<const GlobalPlan> cached_plan;  // shared, not copied, on a cache hit
  ManifestSkeleton manifest;                      // the last commit's, refilled by the next
  // Loads whose outcome is being gathered, and the last few answered (a
  // report that comes late gets the answer the others got).
  std::map<std::string, LoadOutcomes> load_outcomes;
  std::map<std::string, LoadOutcomeMsg> load_verdicts;
  std::deque<std::string> verdict_order;
  // Aborted pending directories not removed yet; shared with the exit
  // handler, which tries once more when the runtime shuts down first.
  std::shared_ptr<std::set<std::string>> unswept = std::make_shared<std::set<std::string>>();
  // Committed saves' trash directories still to delete, oldest first, with
  // the names left in the first one once listed; shared with the exit
  // handler too.
  struct Trash {
    std::string dir;
    std::optional<std::vector<std::string>> names;
  };
  std::shared_ptr<std::deque<Trash>> trash = std::make_shared<std::deque<Trash>>();
  // Deletions that failed (of trash after its commit had answered, or of
  // leftovers by the gc at a save's start): the next commit's warnings, so
  // the caller hears of space it cannot reclaim. Each directory once: every
  // save's gc tries the same ones again.
  std::vector<Status> undeleted;
  std::set<std::string> undeleted_reported;
};

using coordinator_ptr = coordinator_actor::stateful_pointer<coordinator_state>;

// Timers are messages to this actor itself.
coordinator_actor me(coordinator_ptr self) {
  return self;
}

std::chrono::milliseconds seconds(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

int64_t lease_ms(const coordinator_state& st) {
  return static_cast<int64_t>(st.ctx->opts.lease_seconds * 1000);
}

Result<std::shared_ptr<const GlobalPlan>> global_plan(
    coordinator_state& st, const std::vector<std::shared_ptr<const LocalPlan>>& plans,
    const std::vector<uint64_t>& known, uint8_t owner_policy) {
  GlobalPlanOptions o;
  if (owner_policy == 2 || (owner_policy == 0 && st.ctx->opts.owner_lowest_rank))
    o.policy = OwnerPolicy::lowest_rank;
  std::vector<uint64_t> digests;
  digests.reserve(plans.size() + 1);
  for (size_t r = 0; r < plans.size(); ++r)
    digests.push_back(r < known.size() && known[r] != 0 ? known[r] : plans[r]->digest());
  digests.push_back(static_cast<uint64_t>(o.policy));  // the cache holds one policy's plan
  if (st.cached_plan && digests == st.cached_digests) return st.cached_plan;
  std::vector<LocalPlan> copies;  // only when the plans changed
  copies.reserve(plans.size());
  for (const auto& p : plans) copies.push_back(*p);
  auto gp = make_global_plan(copies, o);
  if (!gp.ok()) return gp.status();
  st.cached_plan = std::make_shared<const GlobalPlan>(std::move(gp).value());
  st.cached_digests = std::move(digests);
  return st.cached_plan;
}

const char* phase_of(const Checkpoint& c) {
  return c.phase == Phase::writing ? "write" : "plan";
}

std::string missing_ranks(const std::vector<bool>& have) {
  std::string s;
  for (size_t r = 0; r < have.size(); ++r)
    if (!have[r]) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// "1", "1, 3" or "1-3": the ranks whose flag is `want`, runs joined.
std::string rank_runs(const std::vector<bool>& have, bool want, size_t* n) {
  std::string s;
  *n = 0;
  for (size_t r = 0; r < have.size();) {
    if (have[r] != want) {
      ++r;
      continue;
    }
    size_t e = r;
    while (e + 1 < have.size() && have[e + 1] == want) ++e;
    s += (s.empty() ? "" : ", ") + std::to_string(r);
    if (e > r) s += (e == r + 1 ? ", " : "-") + std::to_string(e);
    *n += e - r + 1;
    r = e + 1;
  }
  return s;
}

// The plan phase ran out with some ranks' plans missing: they never called
// save (a save under `if rank == 0`, say), which no wait can mend.
Status plan_timed_out(const Checkpoint& c, double limit_s) {
  std::vector<bool> have;
  for (bool p : c.planned) have.push_back(p);
  size_t saving = 0, missing = 0;
  const std::string in = rank_runs(have, true, &saving);
  const std::string out = rank_runs(have, false, &missing);
  char limit[32];
  std::snprintf(limit, sizeof(limit), "%g s", limit_s);
  return Status::timeout(
      (saving == 1 ? "rank " : "ranks ") + in + (saving == 1 ? " is" : " are") + " saving step " +
      std::to_string(c.step) + "; " + (missing == 1 ? "rank " : "ranks ") + out +
      (missing == 1 ? " has" : " have") + " not called save within plan-timeout (" + limit +
      "): every rank calls save_async with its own shards, even for "
      "replicated state");
}

void report_undeleted(coordinator_state& st, const std::string& dir, const Status& why) {
  if (!st.undeleted_reported.insert(dir).second) return;
  log_printf(st.ctx->log, LogLevel::warning, "ferry[rank 0]: warning: %s", why.to_string().c_str());
  st.undeleted.push_back(why);
}

// Removes an aborted checkpoint's pending directory. Other ranks may still
// be writing into it until the abort reaches them, and a file created while
// the directory is being emptied makes rmdir fail: try again a little later,
// a few times (what still stays is gc's once its lease lapses).
void sweep(coordinator_ptr self, const std::string& dir, int32_t tries_left) {
  auto& unswept = *self->state.unswept;
  // A file created between listing and rmdir is seen by the next listing;
  // once rmdir succeeds no writer can create one (opens need the directory).
  bool gone = false;
  {
    Doing doing(*self->state.ctx->threads, kCoordinatorThread, "removing " + dir);
    for (int i = 0; i < 4 && !gone; ++i) gone = remove_all(*self->state.ctx->fs, dir).ok();
  }
  if (gone || tries_left <= 0) {
    unswept.erase(dir);
    return;
  }
  unswept.insert(dir);
  self->delayed_send(me(self), std::chrono::milliseconds(250), atom::sweep_v, dir, tries_left - 1);
}

// Deletes one file of the oldest trash directory (or the directory, once
// empty) and asks for the next step: a checkpoint of thousands of files,
// each taking a while to free on a disk that discards, never holds a plan
// or a load for longer than one file. A failure leaves the directory to gc.
void tidy(coordinator_ptr self) {
  auto& trash = *self->state.trash;
  if (trash.empty()) return;
  Filesystem& fs = *self->state.ctx->fs;
  auto& t = trash.front();
  Doing doing(*self->state.ctx->threads, kCoordinatorThread, "removing " + t.dir);
  Status s;
  // A link put in its place is removed, never followed (as remove_all).
  if (!t.names && fs.unlink(t.dir).ok()) t.names.emplace();
  if (!t.names) {
    auto names = fs.list(t.dir);
    if (names.ok())
      t.names = std::move(*names);
    else if (names.status().code() == StatusCode::not_found)
      t.names.emplace();  // gc was first
    else
      s = names.status();
  }
  bool done = !s.ok();
  if (s.ok() && !t.names->empty()) {
    s = remove_all(fs, join_path(t.dir, t.names->back()));
    t.names->pop_back();
  } else if (s.ok()) {
    s = remove_all(fs, t.dir);
    done = true;
  }
  if (!s.ok())
    report_undeleted(
        self->state, t.dir,
        s.with_context("deleting " + t.dir + ", retired by an earlier commit (left for gc): "));
  if (done || !s.ok()) trash.pop_front();
  if (!trash.empty()) self->send(me(self), atom::tidy_v);
}

// An aborted checkpoint's error, kept for a while, so that a rank whose plan
// comes late gets it at once.
void remember_abort(coordinator_state& st, const std::string& id, const Status& status) {
  if (st.aborted.emplace(id, status).second) st.aborted_order.push_back(id);
  if (st.aborted_order.size() > 16) {
    st.aborted.erase(st.aborted_order.front());
    st.aborted_order.pop_front();
  }
}

// Ends the active checkpoint with an error for everyone still waiting, and
// tells every rank (a rank busy writing has no request open to answer).
void abort_active(coordinator_ptr self, const Status& status, int32_t failed_rank = -1) {
  auto& st = self->state;
  if (!st.active) return;
  Checkpoint& c = *st.active;
  // Swept first: a rank that hears of the abort finds the directory gone.
  if (c.phase == Phase::writing) sweep(self, c.pending_dir, 8);
  if (st.link)
    self->send(st.link, atom::broadcast_v,
               AbortMsg{st.ctx->job_id, c.id, failed_rank, phase_of(c), status});
  else if (st.planner)  // a rank busy writing has no request open to answer
    self->send(st.planner, atom::aborted_v, c.id, status);
  remember_abort(st, c.id, status);
  for (auto& p : c.plan_promises)
    if (p.pending()) p.deliver(PlanReply{st.ctx->job_id, c.id, status, "", {}});
  for (auto& p : c.commit_promises)
    if (p.pending()) p.deliver(CommitMsg{st.ctx->job_id, c.id, status, "", 0});
  st.active.reset();
}

// A save is collective: every rank must ask for the same checkpoint.
Status disagreement(const Checkpoint& c, const PlanRequest& req) {
  auto differ = [&](const char* field, const std::string& first, const std::string& theirs) {
    return Status::invalid_argument(std::string("the ranks disagree on the ") + field +
                                    " of checkpoint " + c.id + ": rank " +
                                    std::to_string(c.first_rank) + " has " + first + ", rank " +
                                    std::to_string(req.rank) + " has " + theirs);
  };
  if (req.step != c.step) return differ("step", std::to_string(c.step), std::to_string(req.step));
  if (req.root != c.root) return differ("root", "'" + c.root + "'", "'" + req.root + "'");
  if (req.overwrite != c.overwrite)
    return differ("overwrite flag", c.overwrite ? "true" : "false",
                  req.overwrite ? "true" : "false");
  if (req.owner_policy != c.owner_policy)
    return differ("owner policy", std::to_string(c.owner_policy), std::to_string(req.owner_policy));
  return Status();
}

void on_all_plans(coordinator_ptr self) {
  auto& st = self->state;
  Checkpoint& c = *st.active;
  auto gp = global_plan(st, c.plans, c.digests, c.owner_policy);
  if (!gp.ok()) return abort_active(self, gp.status());
  char nonce[17];
  std::snprintf(nonce, sizeof(nonce), "%016llx", static_cast<unsigned long long>(st.nonces()));
  c.pending_dir = pending_path(c.root, c.step, st.ctx->job_id, c.id + "-" + std::string(nonce));
  c.lease_owner = st.ctx->job_id + "/" + c.id + "/" + nonce;
  // On failure prepare_pending removes what it created, and only that.
  std::vector<GcReport::Failed> undeleted;
  Status s = [&] {
    Doing doing(*st.ctx->threads, kCoordinatorThread, "preparing " + c.pending_dir);
    return prepare_pending(*st.ctx->fs, c.root, c.pending_dir, c.step, c.overwrite, lease_ms(st),
                           c.lease_owner, st.ctx->opts.fsync, &undeleted);
  }();
  for (const GcReport::Failed& f : undeleted)
    report_undeleted(st, f.path, f.status.with_context("a leftover in the checkpoint root: "));
  if (!s.ok()) return abort_active(self, s);
  c.phase = Phase::writing;
  // Only when asked: every rank's plan on every rank grows with world size squared.
  std::string all;
  if (c.want_all) {
    std::vector<LocalPlan> plans;
    for (const auto& p : c.plans) plans.push_back(*p);
    auto sp = save_plans(plans, **gp, c.files);
    if (!sp.ok()) return abort_active(self, sp.status());
    all = encode_save_plans(*sp);
  }
  for (size_t r = 0; r < c.plan_promises.size(); ++r) {
    if (c.in_process[r]) {
      // Shared with the cached global plan: no copy of its chunks per save.
      c.plan_promises[r].deliver(PlanReply{st.ctx->job_id,
                                           c.id,
                                           Status(),
                                           c.pending_dir,
                                           {},
                                           all,
                                           std::shared_ptr<const RankPlan>(*gp, &(*gp)->ranks[r])});
      continue;
    }
    c.plan_promises[r].deliver(
        PlanReply{st.ctx->job_id, c.id, Status(), c.pending_dir, (*gp)->ranks[r], all});
  }
  for (auto& p : c.plans) p.reset();
  self->delayed_send(me(self), seconds(st.ctx->opts.write_timeout_s), atom::ckpt_due_v, c.id,
                     std::string("write"));
  // Refresh the lease a few times per period so gc never takes a live save.
  self->delayed_send(me(self), std::chrono::milliseconds(lease_ms(st) / 3), atom::lease_v, c.id);
}

// Writes a save's or load's timeline into trace-dir; what fails is only
// logged and returned (a warning: the save or load stands).
Status write_timeline(coordinator_state& st, const TraceHeader& h,
                      const std::vector<RankTrace>& traces) {
  std::vector<RankTrace> ranks;
  for (const RankTrace& t : traces)
    if (!t.empty()) ranks.push_back(t);
  if (ranks.empty()) return Status();
  Doing doing(*st.ctx->threads, kCoordinatorThread, "writing a timeline into trace-dir");
  Status s = write_trace_file(*st.ctx->fs, st.ctx->opts.trace_dir, trace_file_name(h),
                              render_chrome_trace(h, ranks));
  if (!s.ok()) std::fprintf(stderr, "ferry[rank 0]: warning: %s\n", s.to_string().c_str());
  return s;
}

void on_all_results(coordinator_ptr self) {
  auto& st = self->state;
  Checkpoint& c = *st.active;
  const int64_t all_in = trace_now_ns();
  std::vector<WriteResult> results;
  for (auto& r : c.results) results.push_back(std::move(*r));
  // Before the commit point: replicas written once must be one value.
  std::vector<RankDigests> digests;
  for (const auto& r : results) digests.push_back({r.rank, &r.replica_digests});
  if (Status s = compare_replica_digests(digests); !s.ok())
    return abort_active(self, s.with_context("rank 0 (commit phase): "));
  Manifest h;
  h.step = c.step;
  h.world_size = st.ctx->world_size;
  h.job_id = st.ctx->job_id;
  h.checkpoint_id = c.id;
  h.fsynced = st.ctx->opts.fsync;
  h.checksum_block_bytes = st.ctx->opts.checksum_block_bytes;
  h.metadata = c.metadata;
  auto m = assemble_manifest_into(st.manifest, h, results);
  if (!m.ok()) return abort_active(self, m.status());
  // Before the commit point: never a committed checkpoint that cannot load.
  // A refill that moved no byte range passes again (ManifestSkeleton::checked).
  if (!st.manifest.checked) {
    sync_chunks(st.manifest);
    if (Status s = check_manifest_before_commit(**m); !s.ok())
      return abort_active(self, s.with_context("rank 0 (commit phase): "));
    st.manifest.checked = st.manifest.valid;
  }
  CommitOptions co{st.ctx->opts.fsync, c.overwrite, st.ctx->opts.keep_last, c.lease_owner};
  co.renew_lease_ms = lease_ms(st);
  co.manifests = st.ctx->manifests.get();
  co.encoder = &st.manifest.encoder;
  co.body = st.manifest.body;
  co.total_bytes = st.manifest.total_bytes;
  const auto commit_started = std::chrono::steady_clock::now();
  Result<CommitOutcome> out = [&] {
    Doing doing(*st.ctx->threads, kCoordinatorThread,
                "the commit of step " + std::to_string(c.step) + " from " + c.pending_dir);
    return commit_checkpoint_in_place(*st.ctx->fs, c.root, c.pending_dir, *m, co);
  }();
  const double commit_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - commit_started).count();
  if (!out.ok())
    return abort_active(self, out.status().with_context("rank 0 (commit phase): commit: "));
  // The ranks stopped waiting at commit-timeout and reported the outcome as
  // unknown; the log says what it was.
  if (commit_s > st.ctx->opts.commit_timeout_s)
    log_printf(st.ctx->log, LogLevel::warning,
               "ferry[rank 0]: checkpoint %s committed after %.1f s, past commit-timeout "
               "(%.1f s): the ranks may have reported its outcome as unknown",
               out->path.c_str(), commit_s, st.ctx->opts.commit_timeout_s);
  // Committed: what failed after the commit point does not undo that.
  std::vector<std::string> warnings;
  out->warnings.insert(out->warnings.begin(), st.undeleted.begin(), st.undeleted.end());
  st.undeleted.clear();
  for (const Status& w : out->warnings) {
    warnings.push_back(w.to_string());
    log_printf(st.ctx->log, LogLevel::warning,
               "ferry[rank 0]: warning: checkpoint %s is committed, but: %s", out->path.c_str(),
               warnings.back().c_str());
  }
  // The straggler, from what every rank reported with its write result.
  int32_t slowest = -1;
  double slowest_ms = -1;
  for (const auto& r : results)
    if (r.ready_ms > slowest_ms) {
      slowest = r.rank;
      slowest_ms = r.ready_ms;
    }
  if (!st.ctx->opts.trace_dir.empty() && !c.traces.empty() && !c.traces[0].empty()) {
    // Rank 0's commit: replica digests, the manifest and commit_checkpoint.
    c.traces[0].spans.push_back({"commit", "commit", all_in, trace_now_ns(), 0, -1});
    TraceHeader h{"save", c.id, c.step, out->path, "commit"};
    if (Status s = write_timeline(st, h, c.traces); !s.ok()) warnings.push_back(s.to_string());
  }
  for (auto& p : c.commit_promises)
    p.deliver(CommitMsg{st.ctx->job_id, c.id, Status(), out->path, out->commit_seq, slowest,
                        slowest_ms, warnings});
  st.active.reset();
  // Sent after the answers: the ranks hear of the commit first.
  if (!out->trash.empty() && st.trash->empty()) self->send(me(self), atom::tidy_v);
  for (std::string& dir : out->trash) st.trash->push_back({std::move(dir), std::nullopt});
}

// A load is collective: every rank must name the same checkpoint. A path
// spelled differently that resolves to the same directory is the same one.
LoadReplyMsg same_load(const coordinator_state& st, const ResolvedLoad& first,
                       const LoadRequestMsg& req) {
  if (req.path == first.path) return first.reply;
  auto dir = resolve_checkpoint(*st.ctx->fs, req.path, st.ctx->manifests.get());
  if (dir.ok() && first.reply.status.ok() && *dir == first.reply.dir) return first.reply;
  LoadReplyMsg r{st.ctx->job_id, req.load_id, Status(), "", ""};
  r.status =
      Status::invalid_argument("the ranks disagree on the checkpoint of " + req.load_id +
                               ": rank " + std::to_string(first.rank) + " loads '" + first.path +
                               "', rank " + std::to_string(req.rank) + " loads '" + req.path + "'");
  return r;
}

// --- load outcomes -----------------------------------------------------------------
//
// A load is collective in its outcome: each rank reports how its part went,
// and rank 0 answers every rank once all reported, a rank failed, or
// write-timeout passed since the first report. Reads take about as long as
// the writes of a save, hence that timeout.

// The load's outcome from what the ranks reported: the error of the lowest
// failing rank, prefixed with that rank, or ok. An error every rank reported
// alike (the path resolved to nothing, say) is no one rank's: it goes
// unprefixed.
LoadOutcomeMsg reported_outcome(const coordinator_state& st, const std::string& id,
                                const LoadOutcomes& lo) {
  LoadOutcomeMsg v{st.ctx->job_id, id, st.ctx->rank, Status(), -1};
  for (size_t r = 0; r < lo.status.size(); ++r) {
    if (!lo.status[r] || lo.status[r]->ok()) continue;
    const Status& first = *lo.status[r];
    bool alike = lo.in == lo.status.size();
    for (const auto& s : lo.status)
      alike = alike && s->code() == first.code() && s->message() == first.message();
    v.failed_rank = static_cast<int32_t>(r);
    v.status = alike ? first : first.with_context("rank " + std::to_string(r) + ": ");
    break;
  }
  if (v.status.ok()) v.needs = lo.needs;
  return v;
}

void answer_load(coordinator_ptr self, const std::string& id, const LoadOutcomeMsg& verdict) {
  auto& st = self->state;
  auto it = st.load_outcomes.find(id);
  if (it == st.load_outcomes.end()) return;
  for (auto& p : it->second.promises)
    if (p.pending()) p.deliver(verdict);
  if (!st.ctx->opts.trace_dir.empty() && !it->second.traces.empty()) {
    std::string dir;
    if (auto l = st.loads.find(id); l != st.loads.end()) dir = l->second.reply.dir;
    // Load ids start again with every job: the time keeps the files apart.
    (void)write_timeline(st, {"load", std::to_string(now_unix_ms()) + "-" + id, 0, dir, ""},
                         it->second.traces);
  }
  st.load_outcomes.erase(it);
  st.load_verdicts[id] = verdict;
  st.verdict_order.push_back(id);
  if (st.verdict_order.size() > 8) {  // late reports come within a timeout; keep a few
    st.load_verdicts.erase(st.verdict_order.front());
    st.verdict_order.pop_front();
  }
}

// Ends a load before every rank reported: `why` (from `rank`) unless a rank
// already reported an error, which is what went wrong first.
void end_load(coordinator_ptr self, const std::string& id, int32_t rank, const Status& why) {
  auto& st = self->state;
  auto it = st.load_outcomes.find(id);
  if (it == st.load_outcomes.end()) return;
  LoadOutcomeMsg v = reported_outcome(st, id, it->second);
  if (v.status.ok()) {
    v.status = why;
    v.failed_rank = rank;
  }
  answer_load(self, id, v);
}

caf::result<LoadOutcomeMsg> on_load_outcome(coordinator_ptr self, LoadOutcomeMsg& report) {
  auto& st = self->state;
  const std::string id = report.load_id;
  if (auto v = st.load_verdicts.find(id); v != st.load_verdicts.end()) return v->second;
  const auto world = static_cast<size_t>(st.ctx->world_size);
  if (report.rank < 0 || static_cast<size_t>(report.rank) >= world)
    return LoadOutcomeMsg{
        st.ctx->job_id, id, st.ctx->rank,
        Status::invalid_argument("load outcome from rank " + std::to_string(report.rank) +
                                 " outside world size " + std::to_string(world)),
        report.rank};
  auto [it, fresh] = st.load_outcomes.try_emplace(id);
  LoadOutcomes& lo = it->second;
  if (fresh) {
    lo.status.resize(world);
    lo.promises.resize(world);
    self->delayed_send(me(self), seconds(st.ctx->opts.write_timeout_s), atom::load_due_v, id);
  }
  const auto r = static_cast<size_t>(report.rank);
  auto rp = self->make_response_promise<LoadOutcomeMsg>();
  if (!lo.status[r]) ++lo.in;
  lo.status[r] = std::move(report.status);
  lo.promises[r] = rp;
  for (auto& n : report.needs) {
    n.rank = report.rank;  // a rank speaks for itself only
    lo.needs.push_back(std::move(n));
  }
  if (!report.trace.empty()) {
    lo.traces.resize(world);
    lo.traces[r] = std::move(report.trace);
    lo.traces[r].rank = report.rank;
  }
  if (lo.in == world) {
    answer_load(self, id, reported_outcome(st, id, lo));
    return rp;
  }
  // A rank that failed earlier never reports: no need to wait for it.
  for (const auto& [rank, why] : st.failed)
    if (static_cast<size_t>(rank) < world && !lo.status[rank]) {
      end_load(self, id, rank,
               Status::aborted("rank " + std::to_string(rank) +
                               " failed before it reported its load outcome: " + why.message()));
      break;
    }
  return rp;
}

void on_load_due(coordinator_ptr self, const std::string& id) {
  auto& st = self->state;
  auto it = st.load_outcomes.find(id);
  if (it == st.load_outcomes.end()) return;
  std::vector<bool> have;
  int32_t first_missing = -1;
  for (size_t r = 0; r < it->second.status.size(); ++r) {
    have.push_back(it->second.status[r].has_value());
    if (!have.back() && first_missing < 0) first_missing = static_cast<int32_t>(r);
  }
  end_load(self, id, first_missing,
           Status::timeout("load " + id + ": no outcome from rank(s) " + missing_ranks(have) +
                           " within write-timeout (" +
                           std::to_string(st.ctx->opts.write_timeout_s) + " s)"));
}

// A rank failed: every load still waiting for its outcome ends, naming it.
void fail_loads(coordinator_ptr self, int32_t rank, const Status& why) {
  auto& st = self->state;
  std::vector<std::string> waiting;
  for (const auto& [id, lo] : st.load_outcomes)
    if (rank >= 0 && static_cast<size_t>(rank) < lo.status.size() && !lo.status[rank])
      waiting.push_back(id);
  for (const auto& id : waiting)
    end_load(self, id, rank,
             Status::aborted("rank " + std::to_string(rank) +
                             " failed during the load: " + why.message()));
}

coordinator_actor::behavior_type coordinator_fun(coordinator_ptr self, ContextPtr ctx) {
  self->state.ctx = std::move(ctx);
  // Runs last in the coordinator's thread: the runtime's shutdown waits for
  // ended(), a bounded time, and names what the thread is stuck in if not.
  self->attach_functor([fs = self->state.ctx->fs, threads = self->state.ctx->threads,
                        unswept = self->state.unswept, trash = self->state.trash] {
    {
      Doing doing(*threads, kCoordinatorThread, "removing aborted and replaced directories");
      for (const auto& dir : *unswept) (void)remove_all(*fs, dir);
      for (const auto& t : *trash) (void)remove_all(*fs, t.dir);
    }
    threads->ended(kCoordinatorThread);
  });
  return {
      [self](atom::plan, PlanRequest& req) -> caf::result<PlanReply> {
        auto& st = self->state;
        const auto world = static_cast<size_t>(st.ctx->world_size);
        if (req.rank < 0 || static_cast<size_t>(req.rank) >= world)
          return PlanReply{st.ctx->job_id,
                           req.checkpoint_id,
                           Status::invalid_argument("plan from rank " + std::to_string(req.rank) +
                                                    " outside world size " + std::to_string(world)),
                           "",
                           {}};
        if (auto it = st.aborted.find(req.checkpoint_id); it != st.aborted.end())
          return PlanReply{st.ctx->job_id, req.checkpoint_id, it->second, "", {}};
        if (st.active && st.active->id != req.checkpoint_id)
          abort_active(self, Status::aborted("superseded by checkpoint " + req.checkpoint_id));
        if (!st.active) {
          Checkpoint c;
          c.id = req.checkpoint_id;
          c.first_rank = req.rank;
          c.step = req.step;
          c.root = req.root;
          c.overwrite = req.overwrite;
          c.owner_policy = req.owner_policy;
          c.plans.resize(world);
          c.planned.resize(world);
          c.digests.resize(world);
          c.in_process.resize(world);
          c.files.resize(world);
          c.plan_promises.resize(world);
          c.results.resize(world);
          c.commit_promises.resize(world);
          st.active = std::move(c);
          self->delayed_send(me(self), seconds(st.ctx->opts.plan_timeout_s), atom::ckpt_due_v,
                             req.checkpoint_id, std::string("plan"));
        }
        Checkpoint& c = *st.active;
        if (req.rank == 0) c.metadata = req.metadata;
        c.want_all = c.want_all || req.want_all;
        if (!st.link && !st.planner)
          st.planner = caf::actor_cast<planner_actor>(self->current_sender());
        if (Status d = disagreement(c, req); !d.ok()) {
          auto rp = self->make_response_promise<PlanReply>();
          c.plan_promises[req.rank] = rp;
          abort_active(self, d, req.rank);
          return rp;
        }
        if (!st.failed.empty()) {
          const auto& [rank, why] = *st.failed.begin();
          auto rp = self->make_response_promise<PlanReply>();
          c.plan_promises[req.rank] = rp;
          abort_active(self,
                       Status::aborted("rank " + std::to_string(rank) +
                                       " failed before the plan phase: " + why.message()),
                       rank);
          return rp;
        }
        auto rp = self->make_response_promise<PlanReply>();
        if (!c.planned[req.rank]) ++c.plans_in;
        c.planned[req.rank] = true;
        c.in_process[req.rank] = req.shared != nullptr;
        c.digests[req.rank] = req.shared ? req.shared_digest : 0;
        c.plans[req.rank] = req.shared ? std::move(req.shared)
                                       : std::make_shared<const LocalPlan>(std::move(req.plan));
        c.files[req.rank] = std::move(req.files);
        c.plan_promises[req.rank] = rp;
        if (c.plans_in == world) on_all_plans(self);
        return rp;
      },
      [self](atom::commit, CommitRequest& req) -> caf::result<CommitMsg> {
        auto& st = self->state;
        // Aborted already: the rank gets the cause, as the others did.
        if (auto it = st.aborted.find(req.checkpoint_id); it != st.aborted.end())
          return CommitMsg{st.ctx->job_id, req.checkpoint_id, it->second, "", 0};
        if (!st.active || st.active->id != req.checkpoint_id || st.active->phase != Phase::writing)
          return CommitMsg{st.ctx->job_id, req.checkpoint_id,
                           Status::aborted("checkpoint " + req.checkpoint_id + " is not active"),
                           "", 0};
        Checkpoint& c = *st.active;
        const auto r = static_cast<size_t>(req.result.rank);
        if (r >= c.results.size())
          return CommitMsg{st.ctx->job_id, req.checkpoint_id,
                           Status::invalid_argument("write result from unknown rank"), "", 0};
        auto rp = self->make_response_promise<CommitMsg>();
        if (!c.results[r]) ++c.results_in;
        c.results[r] = std::move(req.result);
        if (!req.trace.empty()) {
          c.traces.resize(c.results.size());
          c.traces[r] = std::move(req.trace);
          c.traces[r].rank = static_cast<int32_t>(r);
        }
        c.commit_promises[r] = rp;
        if (c.results_in == c.results.size()) on_all_results(self);
        return rp;
      },
      [self](atom::abort_ckpt, const std::string& id, const Status& why) {
        auto& st = self->state;
        if (st.active && st.active->id == id) return abort_active(self, why);
        // Aborted already: the rank that failed late (perhaps because of
        // the abort) waits for the checkpoint's cause.
        auto it = st.aborted.find(id);
        if (it == st.aborted.end()) {
          // A rank that cannot take part aborts before any rank asked: the
          // others get the error when their plans arrive.
          remember_abort(st, id, why);
          return;
        }
        if (st.link)
          self->send(st.link, atom::broadcast_v,
                     AbortMsg{st.ctx->job_id, id, -1, "write", it->second});
        else if (st.planner)
          self->send(st.planner, atom::aborted_v, id, it->second);
      },
      [self](atom::attach_link, abort_broadcast_actor link) { self->state.link = std::move(link); },
      [self](atom::rank_failed, int32_t rank, const Status& why) {
        auto& st = self->state;
        st.failed.emplace(rank, why);
        fail_loads(self, rank, why);
        if (!st.active) return;
        abort_active(self,
                     Status::aborted("rank " + std::to_string(rank) + " failed during the " +
                                     phase_of(*st.active) + " phase: " + why.message()),
                     rank);
      },
      [self](atom::rank_rejoined, int32_t rank) {
        auto& st = self->state;
        // The checkpoint it failed was aborted at rank_failed and stays so;
        // one started since failed at its first plan, so none is active.
        if (st.active) {
          log_printf(st.ctx->log, LogLevel::warning,
                     "ferry[rank 0]: rank %d rejoined during checkpoint %s; it stays failed", rank,
                     st.active->id.c_str());
          return;
        }
        if (st.failed.erase(rank) > 0)
          log_printf(st.ctx->log, LogLevel::warning,
                     "ferry[rank 0]: rank %d rejoined; the next checkpoint includes it", rank);
      },
      [self](atom::ckpt_due, const std::string& id, const std::string& phase) {
        auto& st = self->state;
        if (!st.active || st.active->id != id || phase != phase_of(*st.active)) return;
        const Checkpoint& c = *st.active;
        if (c.phase == Phase::planning)
          return abort_active(self, plan_timed_out(c, st.ctx->opts.plan_timeout_s));
        std::vector<bool> have;
        if (c.phase == Phase::writing)
          for (const auto& r : c.results) have.push_back(r.has_value());
        else
          for (bool p : c.planned) have.push_back(p);
        const double limit =
            c.phase == Phase::writing ? st.ctx->opts.write_timeout_s : st.ctx->opts.plan_timeout_s;
        abort_active(self, Status::timeout("the " + phase + " phase timed out after " +
                                           std::to_string(limit) + " s waiting for rank(s) " +
                                           missing_ranks(have)));
      },
      [self](atom::resolve, const LoadRequestMsg& req) -> LoadReplyMsg {
        auto& st = self->state;
        auto it = st.loads.find(req.load_id);
        if (it != st.loads.end()) return same_load(st, it->second, req);
        LoadReplyMsg r{st.ctx->job_id, req.load_id, Status(), "", ""};
        auto dir = resolve_checkpoint(*st.ctx->fs, req.path, st.ctx->manifests.get());
        if (!dir.ok()) {
          r.status = dir.status();
        } else {
          r.dir = *dir;
          auto bytes = read_file(*st.ctx->fs, join_path(r.dir, kManifestFileName));
          if (bytes.ok())
            r.manifest = std::move(bytes).value();
          else
            r.status = bytes.status();
        }
        st.loads.emplace(req.load_id, ResolvedLoad{r, req.rank, req.path});
        st.load_order.push_back(req.load_id);
        if (st.load_order.size() > 8) {  // every rank asks within moments; keep a few
          st.loads.erase(st.load_order.front());
          st.load_order.pop_front();
        }
        return r;
      },
      [self](atom::outcome, LoadOutcomeMsg& report) -> caf::result<LoadOutcomeMsg> {
        return on_load_outcome(self, report);
      },
      [self](atom::load_due, const std::string& id) { on_load_due(self, id); },
      [self](atom::lease, const std::string& id) {
        auto& st = self->state;
        if (!st.active || st.active->id != id || st.active->phase != Phase::writing) return;
        // A lease we cannot keep fresh may lapse, and gc may then take the
        // files: the save must fail rather than commit what may be gone.
        Status s = write_lease(*st.ctx->fs, st.active->pending_dir, now_unix_ms() + lease_ms(st),
                               st.active->lease_owner);
        if (!s.ok())
          return abort_active(self,
                              s.with_context("rank 0 (write phase): refreshing the lease of " +
                                             st.active->pending_dir + ": "));
        self->delayed_send(me(self), std::chrono::milliseconds(lease_ms(st) / 3), atom::lease_v,
                           id);
      },
      [self](atom::sweep, const std::string& dir, int32_t tries_left) {
        sweep(self, dir, tries_left);
      },
      [self](atom::tidy) { tidy(self); },
  };
}

}  // namespace

coordinator_actor spawn_coordinator(caf::actor_system& sys, ContextPtr ctx) {
  return sys.spawn<caf::detached>(coordinator_fun, std::move(ctx));
}

}  // namespace ferry
