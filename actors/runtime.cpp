// The Runtime facade (declared in src/include/ferry/runtime.hpp): owns the
// actor system of this process and the objects built once at start.

#include "ferry/runtime.hpp"

#include <unistd.h>
#include <algorithm>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <utility>

#include <caf/thread_hook.hpp>

#include "actors/actors.hpp"
#include "actors/messages.hpp"
#include "actors/runtime_access.hpp"
#include "catalog.hpp"
#include "checksum.hpp"
#include "config_ini.hpp"
#include "cuda/device_cuda.hpp"
#include "drills/fault_fs.hpp"
#include "drills/kill_point.hpp"
#include "node.hpp"
#include "object_fs.hpp"
#include "s3/client.hpp"
#include "verify.hpp"

namespace ferry {

// --- SaveHandle ------------------------------------------------------------------

namespace {
const Status& no_save() {
  static const Status s = Status::invalid_argument("empty SaveHandle");
  return s;
}
}  // namespace

Status SaveHandle::wait_snapshot() const {
  if (!s_) return no_save();
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait(lock, [this] { return s_->snapshot_done; });
  return s_->snapshot_status;
}

Status SaveHandle::wait_committed() const {
  if (!s_) return no_save();
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait(lock, [this] { return s_->done; });
  return s_->status;
}

Status SaveHandle::wait_snapshot(std::chrono::milliseconds timeout) const {
  if (!s_) return no_save();
  std::unique_lock<std::mutex> lock(s_->mu);
  if (!s_->cv.wait_for(lock, timeout, [this] { return s_->snapshot_done; }))
    return Status::timeout("the snapshot of step " + std::to_string(s_->step) +
                           " is not done after " + std::to_string(timeout.count()) + " ms");
  return s_->snapshot_status;
}

Status SaveHandle::wait_snapshot(void* stream, const Device& stream_device) const {
  if (!s_) return no_save();
  const bool host_tensors =
      std::any_of(std::as_const(s_->sd).entries().begin(), std::as_const(s_->sd).entries().end(),
                  [](const StateEntry& e) { return e.view.device.is_host(); });
  // Nothing on the GPU to order the stream after: the host copies are the
  // snapshot.
  if (host_tensors || !s_->device) return wait_snapshot();
  {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait(lock, [this] { return (s_->copies_issued && !s_->hashing) || s_->snapshot_done; });
    if (s_->snapshot_done) return s_->snapshot_status;
  }
  Status st = order_stream_after(*s_->device, s_->sd, stream_device, stream);
  return st.with_context(st.ok() ? "" : "wait_snapshot of step " + std::to_string(s_->step) + ": ");
}

Status SaveHandle::wait_committed(std::chrono::milliseconds timeout) const {
  if (!s_) return no_save();
  std::unique_lock<std::mutex> lock(s_->mu);
  if (!s_->cv.wait_for(lock, timeout, [this] { return s_->done; }))
    return Status::timeout("the save of step " + std::to_string(s_->step) + " is not over after " +
                           std::to_string(timeout.count()) + " ms");
  return s_->status;
}

std::vector<std::string> SaveHandle::warnings() const {
  if (!s_) return {};
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->warnings;
}

bool SaveHandle::snapshot_done() const {
  if (!s_) return true;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->snapshot_done;
}

bool SaveHandle::done() const {
  if (!s_) return true;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->done;
}

uint64_t SaveHandle::step() const {
  return s_ ? s_->step : 0;
}

std::string SaveHandle::path() const {
  if (!s_) return "";
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->path;
}

SaveMetrics SaveHandle::metrics() const {
  if (!s_) return {};
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->metrics;
}

uint64_t SaveHandle::bytes_persisted() const {
  return s_ ? s_->bytes_persisted.load() : 0;
}
uint64_t SaveHandle::bytes_total() const {
  return s_ ? s_->bytes_total.load() : 0;
}

// --- Runtime -----------------------------------------------------------------------

namespace {

// The saves not yet over, so that the planner's death (an exception, an exit)
// ends their waits instead of leaving them blocked forever.
struct SaveRegistry {
  std::mutex mu;
  Status dead;  // not ok once the planner is gone
  std::vector<std::weak_ptr<detail::SaveState>> saves;

  // False (and the save finished) when there is no planner to run it.
  bool add(const std::shared_ptr<detail::SaveState>& s) {
    std::unique_lock<std::mutex> lock(mu);
    if (!dead.ok()) {
      Status why = dead;
      lock.unlock();
      s->finish(why, "");
      return false;
    }
    saves.erase(std::remove_if(saves.begin(), saves.end(),
                               [](const std::weak_ptr<detail::SaveState>& w) {
                                 auto p = w.lock();
                                 if (!p) return true;
                                 std::lock_guard<std::mutex> done_lock(p->mu);
                                 return p->done;
                               }),
                saves.end());
    saves.push_back(s);
    return true;
  }

  void planner_gone(Status why) {
    std::vector<std::weak_ptr<detail::SaveState>> left;
    {
      std::lock_guard<std::mutex> lock(mu);
      dead = why;
      left.swap(saves);
    }
    for (auto& w : left)
      if (auto s = w.lock()) s->finish(why, "");
  }
};

// Each thread CAF ends gives back its HTTP stack's per-thread state first
// (see s3::release_thread_state): a detached actor's thread may still be
// ending when the process exits.
class ReleaseThreadState : public caf::thread_hook {
 public:
  void init(caf::actor_system&) override {}
  void thread_started() override {}
  void thread_terminates() override { s3::release_thread_state(); }
};

}  // namespace

// Not part of the ABI: without this it would share Runtime's exported visibility.
struct __attribute__((visibility("hidden"))) Runtime::Impl {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::shared_ptr<RankContext> ctx;
  coordinator_actor coordinator;  // rank 0
  link_actor link;                // world size > 1
  planner_actor planner;
  loader_actor loader;
  std::shared_ptr<Transport> transport;
  uint64_t loads = 0;     // collective load counter: the load id every rank agrees on
  uint64_t resolves = 0;  // the same for Runtime::resolve
  bool joined = false;    // every rank connected: shutdown waits for them to leave
  std::mutex mu;          // serializes save_async callers
  std::shared_ptr<detail::SaveState> last;
  // The last doomed save: its abort must reach rank 0 before this rank says
  // goodbye, or the others hear "left the job" instead of why.
  std::mutex doomed_mu;
  std::shared_ptr<detail::SaveState> last_doomed;
  std::shared_ptr<SaveRegistry> saves = std::make_shared<SaveRegistry>();
  // The share ring this rank offers its loads' senders, kept between loads
  // (taken out while one runs, so a load at the same time makes its own).
  // A ring's pages are faulted by the senders' first pass through it: 2,300
  // pages per sender at the default window, 20 ms of a 2-rank load on the
  // test VM, paid once per runtime instead of once per load. It holds at
  // most (local ranks - 1) x (share-window + a frame) of memory meanwhile.
  std::mutex ring_mu;
  std::shared_ptr<const ShareRing> idle_ring;
};

namespace {

// What this rank asks rank 0 through: the coordinator itself on rank 0, the
// link standing in for it elsewhere. Both serve coordinator_api.
coordinator_api rank0_api(const Runtime::Impl& im) {
  if (im.ctx->rank == 0) return im.coordinator;
  return im.link;
}

}  // namespace

namespace {

Result<int32_t> env_int(const char* name, int32_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > (1 << 24))
    return Status::invalid_argument(std::string("environment ") + name + "=\"" + v +
                                    "\" is not a valid number");
  return static_cast<int32_t>(x);
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// The job token every rank of one job shares (guards against mix-ups between
// jobs, not against attackers): ours, else torchrun's, else Slurm's.
std::string job_token_from_env() {
  for (const char* var : {"FERRY_JOB_TOKEN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"}) {
    const char* v = std::getenv(var);
    if (v && *v) return v;
  }
  return "";
}

// A job id safe inside a directory name, the same on every rank.
std::string job_id_from_env(const std::string& token) {
  std::string raw;
  for (const char* var : {"FERRY_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"})
    if (raw.empty()) raw = env_or(var, "");
  if (raw.empty() && !token.empty()) {
    char buf[20];
    std::snprintf(buf, sizeof(buf), "j%08llx",
                  static_cast<unsigned long long>(xxh3_64(token.data(), token.size()) >> 32));
    raw = buf;
  }
  if (raw.empty()) return "local";
  std::string id;
  for (char c : raw)
    if (id.size() < 32) id.push_back(std::isalnum(static_cast<unsigned char>(c)) ? c : '_');
  return id;
}

// Connects this rank to the others (world size > 1): rank 0 listens and
// admits ranks that present the job token; the others join it.
Status start_transport(Runtime::Impl& impl, const std::string& token) {
  const RankContext& ctx = *impl.ctx;
  if (token.empty())
    return Status::invalid_argument(
        "no job token: set FERRY_JOB_TOKEN (or run under torchrun or Slurm) so the ranks of "
        "one job can recognise each other");
  TransportOptions to;
  to.rank = ctx.rank;
  to.world_size = ctx.world_size;
  to.host = !ctx.opts.coordinator_address.empty() ? ctx.opts.coordinator_address
                                                  : env_or("MASTER_ADDR", "127.0.0.1");
  uint32_t port = ctx.opts.port;
  if (port == 0) {
    FERRY_ASSIGN_OR_RETURN(int32_t master, env_int("MASTER_PORT", 0));
    if (master <= 0 || master >= 65535)
      return Status::invalid_argument(
          "no port for the ranks to meet: set MASTER_PORT or "
          "ferry.port");
    port = static_cast<uint32_t>(master) + 1;
  }
  to.port = static_cast<uint16_t>(port);
  to.connect_timeout_s = ctx.opts.connect_timeout_s;
  to.heartbeat_interval_s = ctx.opts.heartbeat_interval_s;
  to.heartbeat_timeout_s = ctx.opts.heartbeat_timeout_s;
  to.rejoin_timeout_s = ctx.opts.rejoin_timeout_s;
  to.lanes = ctx.opts.direct_lanes;
  to.lane_info = ctx.opts.lane_info;
  to.frame_buffers = ctx.frames;
  to.logger = ctx.log;

  const std::string hello =
      encode_message(JoinMsg{ctx.job_id, token, ctx.rank, ctx.world_size, host_name(), getpid()});
  const std::string heartbeat = encode_message(HeartbeatMsg{ctx.job_id, ctx.rank, 0});

  // Ranks > 0: the join verdict and the start barrier, from the progress thread.
  struct Verdict {
    std::mutex mu;
    std::condition_variable cv;
    Status status;
    bool all_joined = false;
    Status rank0_lost;           // rank 0 died before it said every rank joined
    int64_t rank0_clock_ns = 0;  // from the first ack: the timeline's clock offset
  };
  auto verdict = std::make_shared<Verdict>();
  TransportCallbacks cb;
  const std::string job = ctx.job_id;
  const int32_t world = ctx.world_size;
  cb.accept = [token, job, world, log = ctx.log](const std::string& bytes,
                                                 std::string* reply) -> Result<int32_t> {
    auto m = decode_message(bytes);
    Status why;
    int32_t rank = -1;
    if (!m.ok()) {
      why = m.status().with_context("malformed join: ");
    } else if (auto* j = std::get_if<JoinMsg>(&*m); j == nullptr) {
      why = Status::invalid_argument(std::string("expected a Join, got ") + message_name(*m));
    } else if (j->token != token) {
      why = Status::invalid_argument("rank " + std::to_string(j->rank) + " (pid " +
                                     std::to_string(j->pid) + " on " + j->host +
                                     ") presented a different job token");
    } else if (j->world_size != world) {
      why = Status::invalid_argument("rank " + std::to_string(j->rank) + " has world size " +
                                     std::to_string(j->world_size) + ", rank 0 has " +
                                     std::to_string(world));
    } else {
      rank = j->rank;
    }
    if (!why.ok()) {
      log_printf(log, LogLevel::warning, "ferry[rank 0]: refused a process: %s",
                 why.to_string().c_str());
      *reply = encode_message(JoinAckMsg{job, why});
      return why;
    }
    *reply = encode_message(JoinAckMsg{job, Status(), false, trace_now_ns()});
    return rank;
  };
  link_actor link = impl.link;
  const bool rank0 = ctx.rank == 0;
  cb.on_frame = [link, verdict, rank0](int32_t from, std::string bytes) {
    // A JoinAck is small; shared load bytes are not decoded twice here.
    if (!rank0 && from == 0 && bytes.size() <= (64u << 10)) {
      auto m = decode_message(bytes);
      if (m.ok() && std::holds_alternative<JoinAckMsg>(*m)) {
        const auto& ack = std::get<JoinAckMsg>(*m);
        std::lock_guard<std::mutex> lock(verdict->mu);
        verdict->status = ack.status;
        if (!ack.all_joined && verdict->rank0_clock_ns == 0) verdict->rank0_clock_ns = ack.clock_ns;
        verdict->all_joined = verdict->all_joined || ack.all_joined;
        verdict->cv.notify_all();
        return;
      }
    }
    caf::anon_send(link, atom::frame_v, from, std::move(bytes));
  };
  cb.on_peer_failed = [link, verdict, rank0](int32_t rank, Status why) {
    if (!rank0 && rank == 0) {
      // Its "every rank joined" may have died with it: waiting on would
      // take connect-timeout.
      std::lock_guard<std::mutex> lock(verdict->mu);
      if (verdict->rank0_lost.ok()) verdict->rank0_lost = why;
      verdict->cv.notify_all();
    }
    caf::anon_send(link, atom::peer_failed_v, rank, std::move(why));
  };
  cb.on_peer_rejoined = [link](int32_t rank) { caf::anon_send(link, atom::peer_rejoined_v, rank); };
  FERRY_ASSIGN_OR_RETURN(auto t, Transport::start(to, hello, heartbeat, std::move(cb)));
  impl.transport = std::move(t);
  caf::anon_send(impl.link, atom::attach_net_v, impl.transport, impl.planner);
  Status s = impl.transport->wait_peers(ctx.opts.connect_timeout_s);
  const std::string me = "rank " + std::to_string(ctx.rank);
  if (rank0) {
    if (!s.ok() && s.code() == StatusCode::timeout)
      // The `if rank == 0: save` habit with a runtime the save starts.
      return Status(s.code(), me + " waiting for the other ranks: " + s.message() +
                                  ": every rank starts Ferry and calls save_async (or load) with "
                                  "its own shards, even for replicated state");
    if (!s.ok()) return s.with_context(me + " waiting for the other ranks: ");
    // The start barrier: no rank starts (and maybe finishes and leaves)
    // before every rank is connected.
    const std::string ready = encode_message(JoinAckMsg{ctx.job_id, Status(), true});
    for (int32_t r = 1; r < ctx.world_size; ++r)
      FERRY_RETURN_IF_ERROR(impl.transport->send(r, ready));
    return Status();
  }
  std::unique_lock<std::mutex> lock(verdict->mu);
  verdict->cv.wait_for(
      lock, std::chrono::milliseconds(static_cast<int64_t>(ctx.opts.connect_timeout_s * 1000)),
      [&] { return !verdict->status.ok() || verdict->all_joined || !verdict->rank0_lost.ok(); });
  if (!verdict->status.ok()) return verdict->status.with_context("rank 0 refused " + me + ": ");
  if (!verdict->all_joined && !verdict->rank0_lost.ok())
    return Status::aborted(
        me + ": rank 0 failed before every rank joined: " + verdict->rank0_lost.message());
  if (!s.ok()) return s.with_context(me + " connecting: ");
  if (!verdict->all_joined)
    return Status::timeout(me + ": not every rank joined within " +
                           std::to_string(ctx.opts.connect_timeout_s) + " s");
  if (verdict->rank0_clock_ns != 0) {
    const auto [sent, replied] = impl.transport->join_round_trip();
    const ClockOffset c = clock_offset(sent, verdict->rank0_clock_ns, replied);
    ctx.trace_clock->offset_ns = c.offset_ns;
    ctx.trace_clock->error_ns = c.error_ns;
  }
  // Lanes are a shortcut (frames go through rank 0 without them), so one that
  // is late costs a log line, not the start.
  if (Status l = impl.transport->wait_lanes(ctx.opts.connect_timeout_s); !l.ok())
    log_printf(ctx.log, LogLevel::warning, "ferry[rank %d]: %s", ctx.rank, l.message().c_str());
  return Status();
}

std::string config_file_from(const RuntimeArgs& args) {
  if (!args.config_file.empty()) return args.config_file;
  const std::string flag = "--config-file=";
  for (const auto& a : args.argv)
    if (a.compare(0, flag.size(), flag) == 0) return a.substr(flag.size());
  return "";
}

}  // namespace

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Runtime>> Runtime::create(RuntimeArgs args) {
  const std::string config_file = config_file_from(args);
  std::string actor_config;  // the config file's bytes, for CAF too
  FERRY_ASSIGN_OR_RETURN(Options opts, load_options(args.settings, config_file, &actor_config));
  if (args.world_size < 1 || args.rank < 0 || args.rank >= args.world_size)
    return Status::invalid_argument("rank " + std::to_string(args.rank) + " outside world size " +
                                    std::to_string(args.world_size));

  auto impl = std::make_unique<Impl>();
  // Ferry is a guest in the training process: a few scheduler threads are
  // plenty for message passing (blocking I/O has its own threads).
  impl->cfg.set("scheduler.max-threads", 2);
  // An idle scheduler thread spins briefly, then sleeps 50 us at a time,
  // 500 times by CAF's default, before it waits on its condition variable.
  // Those sleeps were a third of a load's kernel CPU; 10 of them still made
  // 2,200 context switches per 2-rank load, and that CPU slowed the disk
  // (2-rank load rounds 0.53-0.71 s, 0.49-0.57 s without). Waking a waiting
  // thread costs its sender one notify, so it waits at once.
  impl->cfg.set("work-stealing.moderate-poll-attempts", 0);
  impl->cfg.set("logger.console-verbosity", caf::atom("quiet"));
  impl->cfg.add_thread_hook<ReleaseThreadState>();
  std::vector<std::string> caf_args;
  for (const auto& a : args.argv)
    if (a.rfind("--config-file=", 0) != 0) caf_args.push_back(a);
  std::istringstream ini(actor_config);
  if (auto err = impl->cfg.parse(caf_args, ini))
    return Status::invalid_argument("actor system config: " + caf::to_string(err));

  auto ctx = std::make_shared<RankContext>();
  ctx->opts = opts;
  ctx->rank = args.rank;
  ctx->world_size = args.world_size;
  if (args.logger) ctx->log = args.logger;
  const std::string token = job_token_from_env();
  ctx->job_id = job_id_from_env(token);
  ctx->host = host_name();
  ctx->run_salt = args.world_size > 1
                      ? xxh3_64(token.data(), token.size())
                      : std::random_device{}() ^ (uint64_t{std::random_device{}()} << 32);
  // FERRY_FAULTS wraps the filesystem in the fault injector (tests, crash
  // drills) without recompiling; unset, this is the plain one.
  // s3:// roots (the configured one or a save's own) go to the S3 store.
  // FERRY_FAULTS' http: rules go under their S3 client (the drills' fault peer).
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<HttpFaults> http, http_faults_from_env());
  std::shared_ptr<Filesystem> base =
      with_object_roots(args.fs ? args.fs : posix_filesystem(), [opts, http] {
        S3StoreOptions o = s3_store_options(opts);
        o.client.hook = http;
        return o;
      });
  FERRY_ASSIGN_OR_RETURN(ctx->fs, filesystem_from_env(std::move(base)));
  // Nothing below a root is reached through a link (Filesystem::add_root).
  if (!opts.root.empty()) ctx->hold_root(opts.root);
  // Crash drills (FERRY_KILL_AT) observe this runtime's crash points only.
  FERRY_ASSIGN_OR_RETURN(ctx->fs, kill_points_from_env(std::move(ctx->fs), args.rank));
  // The CUDA backend when this machine has a GPU (host tensors still take
  // the host path through it), else the host device alone.
  ctx->device = args.device ? args.device : make_default_device(opts);
  // pool-bytes = auto starts with two blocks (one filling, one writing) and
  // grows with the states saved and loaded (StagingPool::grow).
  FERRY_ASSIGN_OR_RETURN(auto pool, StagingPool::create(opts.pool_bytes, opts.chunk_bytes,
                                                        opts.pool_auto ? 2 * opts.chunk_bytes : 0));
  // Pinned once, so device copies run at full speed and O_DIRECT writes go
  // straight from the same blocks; an error names the size and the opt-out.
  FERRY_RETURN_IF_ERROR(register_pool_for_device(*pool, *ctx->device, opts));
  ctx->pool = std::move(pool);
  impl->ctx = ctx;

  impl->sys = std::make_unique<caf::actor_system>(impl->cfg);
  // Each actor thread says when it has ended (the coordinator itself, after
  // its own cleanup): shutdown waits for that a bounded time.
  auto track = [threads = ctx->threads](const auto& actor, const std::string& name) {
    threads->started(name);
    actor->attach_functor([threads, name] { threads->ended(name); });
  };
  if (args.rank == 0) {
    ctx->threads->started(kCoordinatorThread);
    impl->coordinator = spawn_coordinator(*impl->sys, ctx);
  }
  if (args.world_size > 1) {
    impl->link = spawn_link(*impl->sys, ctx, impl->coordinator);
    if (impl->coordinator)
      caf::anon_send(impl->coordinator, atom::attach_link_v, abort_broadcast_actor{impl->link});
  }
  impl->planner = spawn_planner(*impl->sys, ctx, rank0_api(*impl));
  impl->planner->attach_functor([saves = impl->saves](const caf::error& reason) {
    saves->planner_gone(
        reason == caf::exit_reason::user_shutdown
            ? Status::aborted("the runtime shut down before the save ended")
            : Status::internal("Ferry's planner actor died (" + caf::to_string(reason) +
                               "): the save is abandoned; its pending directory is left to gc"));
  });
  impl->loader = spawn_loader(*impl->sys, ctx);
  track(impl->planner, "the planner");
  track(impl->loader, "the loader");
  if (impl->link) track(impl->link, "the link");
  if (impl->link) caf::anon_send(impl->link, atom::attach_loader_v, impl->loader);
  std::unique_ptr<Runtime> rt(new Runtime(std::move(impl)));
  if (args.world_size > 1) {
    FERRY_RETURN_IF_ERROR(start_transport(*rt->impl_, token));
    rt->impl_->joined = true;
  }
  return rt;
}

Result<std::unique_ptr<Runtime>> Runtime::from_env(RuntimeArgs args) {
  FERRY_ASSIGN_OR_RETURN(args.rank, env_int("RANK", 0));
  FERRY_ASSIGN_OR_RETURN(args.world_size, env_int("WORLD_SIZE", 1));
  return create(std::move(args));
}

namespace {

// Runtimes whose threads were left running at shutdown: kept reachable (and
// never freed) for as long as those threads may use them.
void leave_behind(std::unique_ptr<Runtime::Impl> impl) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::unique_ptr<Runtime::Impl>>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(impl));
}

}  // namespace

Runtime::~Runtime() {
  if (!impl_) return;
  std::shared_ptr<detail::SaveState> last;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    last = impl_->last;
  }
  std::shared_ptr<detail::SaveState> doomed;
  {
    std::lock_guard<std::mutex> lock(impl_->doomed_mu);
    doomed = impl_->last_doomed;
  }
  // A bounded wait: a save stuck on storage must not hang the process exit.
  bool in_flight = false;
  for (const auto& s : {last, doomed})
    if (s) {
      std::unique_lock<std::mutex> lock(s->mu);
      in_flight |= !s->cv.wait_for(lock, std::chrono::seconds(60), [&] { return s->done; });
    }
  impl_->ctx->pool->set_release_hook(nullptr);
  if (impl_->link && impl_->joined) {
    caf::scoped_actor self{*impl_->sys};
    // Rank 0 waits (bounded) for the others to leave: they may still need it
    // for a collective load or a commit outcome.
    const double wait_s = impl_->ctx->rank == 0 ? impl_->ctx->opts.write_timeout_s : 5;
    self->request(impl_->link, std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000)),
                  atom::leave_v)
        .receive([](bool) {}, [](caf::error&) {});
  }
  if (impl_->transport) impl_->transport->stop();
  // Detached actors' threads wait until nothing refers to their actor, so
  // drop our handles before the system waits for them.
  auto stop = [](auto& a) {
    if (a) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    a = nullptr;
  };
  stop(impl_->planner);
  stop(impl_->coordinator);
  stop(impl_->loader);
  stop(impl_->link);
  // A writer retired inside a call that never returned (a stalled disk, a
  // checkpoint_fn stuck for good) would hold the actor system's teardown
  // forever: past a short wait, the system and everything it may still
  // touch are left behind, and the process exits around them.
  // A save still in flight may have its writers in such a call too.
  // So would an actor inside a call that never returns (a commit's rename
  // or fsync on a hung mount).
  const auto stragglers = impl_->ctx->stragglers;
  const std::vector<std::string> stuck =
      impl_->ctx->threads->wait_ended(std::chrono::seconds(in_flight ? 0 : 2));
  if (in_flight || !stuck.empty() || !stragglers->wait_none(std::chrono::seconds(2))) {
    std::string what = in_flight ? "a save still in flight" : "";
    for (const std::string& s : stuck) what += (what.empty() ? "" : ", ") + s;
    if (stragglers->count() > 0)
      what += (what.empty() ? "" : ", ") + std::to_string(stragglers->count()) +
              " writer thread(s) still stuck in storage or a checkpoint_fn";
    log_printf(impl_->ctx->log, LogLevel::warning,
               "ferry[rank %d]: at shutdown: %s: its threads are left running", impl_->ctx->rank,
               what.c_str());
    leave_behind(std::move(impl_));
    return;
  }
  impl_->sys.reset();
}

SaveHandle Runtime::save_async(const StateDict& sd, uint64_t step, const SaveOptions& opts) {
  return SaveHandle(detail::RuntimeAccess::start_save(*this, sd, step, opts, std::nullopt, false));
}

// save_async, and SavePlanner's saves, which stop between their steps.
std::shared_ptr<detail::SaveState> detail::RuntimeAccess::start_save(
    Runtime& rt, const StateDict& sd, uint64_t step, SaveOptions opts,
    std::optional<LocalPlan> local, bool staged, CheckpointFn checkpoint_fn, uint8_t owner_policy) {
  auto& impl_ = rt.impl_;
  const auto t0 = detail::SaveState::clock::now();
  auto state = std::make_shared<detail::SaveState>();
  state->step = step;
  // Refused here, at once; with other ranks a doomed job still takes this
  // save's checkpoint id, so the ranks stay in step and hear why now rather
  // than at plan-timeout.
  auto refuse = [&](Status why) {
    state->finish(why, "");
    if (impl_->ctx->world_size > 1) start_doomed_save(rt, step, std::move(why));
    return state;
  };
  if (sd.entries().empty()) {
    return refuse(Status::invalid_argument("save of step " + std::to_string(step) +
                                           ": the state dict is empty (nothing to save)"));
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (auto prev = impl_->last) {
      std::unique_lock<std::mutex> plock(prev->mu);
      if (!prev->snapshot_done) {
        if (impl_->ctx->opts.fail_fast) {
          plock.unlock();
          return refuse(Status::busy("save of step " + std::to_string(step) +
                                     " refused: the save of step " + std::to_string(prev->step) +
                                     " is still taking its snapshot (fail-fast is on)"));
        }
        prev->cv.wait(plock, [&] { return prev->snapshot_done; });
      }
    }
    impl_->last = state;
  }
  std::string root = opts.root.empty() ? impl_->ctx->opts.root : opts.root;
  if (root.empty()) {
    return refuse(
        Status::invalid_argument("no checkpoint root: set ferry.root or SaveOptions::root"));
  }
  impl_->ctx->hold_root(root);
  // Resolved once here: the plan and the writers see this one value.
  auto files = resolve_data_files(impl_->ctx->opts, opts, static_cast<bool>(checkpoint_fn));
  if (!files.ok()) {
    return refuse(files.status().with_context("save of step " + std::to_string(step) + ": "));
  }
  state->started = t0;
  // Here, not in the snapshot actor: the copies must come after what the
  // caller queued on its stream before this call, and before what it queues
  // after it returns.
  if (Status s = order_copies_after(*impl_->ctx->device, sd, opts.stream_device, opts.stream);
      !s.ok()) {
    return refuse(s.with_context("save of step " + std::to_string(step) + ": "));
  }
  state->sd = sd;
  state->device = impl_->ctx->device;
  if (!impl_->saves->add(state)) return state;
  caf::anon_send(
      impl_->planner, atom::save_v,
      SaveJob{sd, step, std::move(opts), root, state, std::move(local), staged,
              std::move(checkpoint_fn), owner_policy, std::move(files).value(), Status()});
  const double ms =
      std::chrono::duration<double, std::milli>(detail::SaveState::clock::now() - t0).count();
  state->update_metrics([ms](SaveMetrics& m) { m.save_async_ms = ms; });
  return state;
}

std::shared_ptr<detail::SaveState> detail::RuntimeAccess::start_doomed_save(Runtime& rt,
                                                                            uint64_t step,
                                                                            Status why) {
  auto state = std::make_shared<detail::SaveState>();
  state->step = step;
  state->started = detail::SaveState::clock::now();
  if (!rt.impl_->saves->add(state)) return state;
  {
    std::lock_guard<std::mutex> lock(rt.impl_->doomed_mu);
    rt.impl_->last_doomed = state;
  }
  SaveJob job;
  job.step = step;
  job.state = state;
  job.doomed = std::move(why);
  caf::anon_send(rt.impl_->planner, atom::save_v, std::move(job));
  return state;
}

Result<DataFileOptions> detail::RuntimeAccess::resolve_file_options(const Runtime& rt,
                                                                    const SaveOptions& opts,
                                                                    bool custom_writer) {
  return resolve_data_files(rt.impl_->ctx->opts, opts, custom_writer);
}

void detail::RuntimeAccess::proceed(Runtime& rt, Proceed p) {
  caf::anon_send(rt.impl_->planner, atom::proceed_v, std::move(p));
}

const RankContext& detail::RuntimeAccess::context(const Runtime& rt) {
  return *rt.impl_->ctx;
}

namespace {

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

Status from_caf(caf::scoped_actor& self, const caf::error& e, const std::string& what) {
  if (e == caf::sec::request_timeout) return Status::timeout(what + ": no answer in time");
  return Status::internal(what + ": " + self->system().render(e));
}

// This rank's plan of a load, against the manifest rank 0 read.
Status plan_load(Runtime::Impl& im, StateDict& sd, const LoadReplyMsg& reply,
                 std::shared_ptr<const Manifest>* manifest, std::vector<LoadRequest>* requests,
                 std::vector<ReadOp>* ops) {
  // Decoded once per runtime: ferry_manifest_open on it decoded the same bytes.
  auto m = decode_manifest_shared(reply.manifest, reply.dir, im.ctx->manifests.get());
  if (!m.ok()) return m.status().with_context(join_path(reply.dir, kManifestFileName) + ": ");
  *manifest = std::move(m).value();
  FERRY_ASSIGN_OR_RETURN(*requests, make_load_requests(sd));
  FERRY_RETURN_IF_ERROR(
      resolve_per_rank(*requests, sd, **manifest, im.ctx->rank, im.ctx->world_size));
  // Device copies into the caller's tensors come after its queued work on
  // them (the legacy default stream); load returns once they have landed.
  FERRY_RETURN_IF_ERROR(order_copies_after(*im.ctx->device, sd, Device::cuda(0), nullptr));
  LoadPlanOptions lo;
  lo.max_read_bytes = im.ctx->opts.chunk_bytes;
  FERRY_ASSIGN_OR_RETURN(*ops, make_load_plan(**manifest, *requests, lo));
  return Status();
}

// trace-dir set: when this rank's load passed its steps (its clock).
struct LoadTimes {
  int64_t start = 0;
  int64_t resolved = 0;  // rank 0 named the checkpoint
  int64_t planned = 0;   // the load plan, and with other ranks who reads what
  std::shared_ptr<LoadClocks> clocks = std::make_shared<LoadClocks>();  // the readers'
};

// This rank's load phases on rank 0's clock.
RankTrace load_trace(const RankContext& ctx, const LoadTimes& t) {
  const int64_t now = trace_now_ns();
  std::vector<TraceSpan> spans = {{"resolve", "load", t.start, t.resolved, 0, -1}};
  if (t.planned > 0) {
    spans.push_back({"plan", "load", t.resolved, t.planned, 0, -1});
    spans.push_back({"read and copy", "load", t.planned, now, 0, -1});
  }
  // Their clocks are this rank's too: offset added below with the others'.
  if (t.clocks->read.used()) spans.push_back(t.clocks->read.span("read", "read", 0));
  if (t.clocks->verify.used()) spans.push_back(t.clocks->verify.span("verify", "verify", 0));
  if (t.clocks->share.used()) spans.push_back(t.clocks->share.span("share", "share", 0));
  RankTrace r;
  r.rank = ctx.rank;
  r.host = ctx.host;
  r.clock_error_ns = ctx.trace_clock->error_ns.load();
  const int64_t offset = ctx.trace_clock->offset_ns.load();
  for (TraceSpan& s : spans) {
    s.start_ns += offset;
    s.end_ns += offset;
  }
  r.spans = std::move(spans);
  return r;
}

// Ranks > 1, before the reads: every rank's plan (or its failure) goes to
// rank 0, and every rank's needs come back, so ranks of one node read the
// bytes they share once. Every rank takes part, failed or not.
Result<std::vector<RankNeeds>> exchange_needs(Runtime::Impl& im, caf::scoped_actor& self,
                                              const std::string& id, const Status& planned,
                                              RankNeeds mine) {
  const Options& o = im.ctx->opts;
  LoadOutcomeMsg report{im.ctx->job_id, id, im.ctx->rank, planned, -1};
  if (planned.ok()) report.needs.push_back(std::move(mine));
  Result<std::vector<RankNeeds>> out = Status::internal("no answer");
  self->request(rank0_api(im), millis(o.write_timeout_s + o.heartbeat_timeout_s + 10),
                atom::outcome_v, std::move(report))
      .receive(
          [&](const LoadOutcomeMsg& v) {
            if (v.status.ok())
              out = v.needs;
            else
              out = v.status;
          },
          [&](caf::error& e) {
            out = from_caf(
                self, e,
                "rank " + std::to_string(im.ctx->rank) + " waiting for the plans of " + id);
          });
  return out;
}

// This rank's part of a load: plan, agree with the other ranks who reads
// what, then read, verify and copy into the caller's tensors (and receive
// what others read for it).
Status load_local(Runtime::Impl& im, caf::scoped_actor& self, StateDict& sd, const std::string& id,
                  const LoadReplyMsg& reply, LoadReport* report, LoadTimes* times) {
  std::shared_ptr<const Manifest> manifest;
  std::vector<LoadRequest> requests;
  std::vector<ReadOp> ops;
  const Status planned =
      reply.status.ok() ? plan_load(im, sd, reply, &manifest, &requests, &ops) : reply.status;
  LoadJob job;
  job.dir = reply.dir;
  job.manifest = manifest;
  if (im.ctx->world_size > 1) {
    const Options& o = im.ctx->opts;
    const std::string node = node_identity();
    report->node = node;
    RankNeeds mine{im.ctx->rank, node, {}, {}};
    if (planned.ok()) {
      mine.ranges = needed_ranges(ops, *manifest);
      // A ring for what others read for this rank, offered whether or not
      // they will: its memory is touched only by senders that use it.
      if (o.share_memory) {
        {
          std::lock_guard<std::mutex> l(im.ring_mu);
          job.ring = std::move(im.idle_ring);
        }
        if (!job.ring) {
          auto ring = ShareRing::create(im.ctx->world_size, o.share_window_bytes);
          if (ring.ok()) job.ring = std::move(ring).value();
        }
        if (job.ring) mine.ring = job.ring->info();
      }
    }
    auto needs = exchange_needs(im, self, id + "/needs", planned, std::move(mine));
    if (!needs.ok()) return needs.status();
    if (times) times->planned = trace_now_ns();
    std::map<int32_t, RingInfo> rings;
    for (const RankNeeds& n : *needs)
      if (o.share_memory && n.rank != im.ctx->rank && n.host == node && n.ring.offered())
        rings[n.rank] = n.ring;
    for (const auto& [peer, info] : rings) report->share_ring_peers.push_back(peer);
    if (!rings.empty())
      job.peer_rings = std::make_shared<PeerRings>(im.ctx->log, im.ctx->rank, im.ctx->world_size,
                                                   o.share_window_bytes, std::move(rings));
    RankShare part =
        split_for_rank(ops, assign_shared_reads(std::move(needs).value(), o.load_sharing_job),
                       im.ctx->rank, *manifest);
    // Freed now: what the load allocates next reuses this memory rather than
    // fresh pages, whose first touch cost 5-20 us each on the test VM.
    std::vector<ReadOp>().swap(ops);
    job.ops = std::move(part.read);
    job.receive = std::move(part.receive);
    job.load_id = id;
    job.transport = im.transport;
  } else {
    FERRY_RETURN_IF_ERROR(planned);
    job.ops = std::move(ops);
  }
  report->path = reply.dir;
  report->step = manifest->step;
  report->tensors_restored = requests.size();
  report->not_restored = tensors_not_requested(*manifest, requests);
  for (const auto& op : job.ops) {
    (op.fetch_from < 0 ? report->bytes_read : report->bytes_fetched) += op.length;
    for (const ShareTo& to : op.share_with)
      if (to.raw) report->bytes_sent_to_hosts += op.length;
  }
  for (const auto& [from, op] : job.receive)
    report->bytes_received += shared_bytes(op, dtype_size(manifest->tensors[op.tensor].dtype));
  auto targets = std::make_shared<std::vector<TensorView>>();
  targets->reserve(sd.size());
  for (const auto& e : sd.entries()) targets->push_back(e.view);
  job.targets = std::move(targets);
  if (times) {
    if (times->planned == 0) times->planned = trace_now_ns();
    job.clocks = times->clocks;
  }

  // No deadline: reads take as long as the checkpoint is large, and the
  // loader answers even when a reader dies (an error comes back at once if
  // the loader itself is gone); bytes from other ranks have their own.
  Status result;
  std::shared_ptr<const ShareRing> ring = job.ring;
  self->request(im.loader, caf::infinite, atom::load_v, std::move(job))
      .receive([&](const Status& s) { result = s; },
               [&](caf::error& e) { result = from_caf(self, e, "load: the loader"); });
  // The next load's senders start their regions over; this load's have
  // stopped writing by now, since a rank answers its load only after its
  // readers ended, and the next load needs every rank.
  if (ring) {
    std::lock_guard<std::mutex> l(im.ring_mu);
    if (!im.idle_ring) im.idle_ring = std::move(ring);
  }
  return result.with_context(result.ok() ? "" : "load " + reply.dir + ": ");
}

// Ranks > 1 (and one rank with trace-dir set): this rank's outcome (and its
// timeline) goes to rank 0, the load's comes back.
Status collective_outcome(Runtime::Impl& im, caf::scoped_actor& self, const std::string& id,
                          const Status& mine, RankTrace trace) {
  const Options& o = im.ctx->opts;
  const int32_t rank = im.ctx->rank;
  coordinator_api to = rank0_api(im);
  Status out;
  // Rank 0 answers within write-timeout of the first report and the link has
  // its own deadline; this one is the last resort against a lost answer.
  self->request(to, millis(o.write_timeout_s + o.heartbeat_timeout_s + 10), atom::outcome_v,
                LoadOutcomeMsg{im.ctx->job_id, id, rank, mine, -1, {}, std::move(trace)})
      .receive([&](const LoadOutcomeMsg& v) { out = v.status; },
               [&](caf::error& e) {
                 out = from_caf(
                     self, e, "rank " + std::to_string(rank) + " waiting for the outcome of " + id);
               });
  return out;
}

// One line, capped, so a big model's log stays readable.
void log_not_restored(const Runtime::Impl& im, const LoadReport& r) {
  if (r.not_restored.empty()) return;
  constexpr size_t kShown = 8;
  std::string keys;
  for (size_t i = 0; i < r.not_restored.size() && i < kShown; ++i)
    keys += (i ? ", " : "") + r.not_restored[i];
  if (r.not_restored.size() > kShown)
    keys += " and " + std::to_string(r.not_restored.size() - kShown) + " more";
  log_printf(im.ctx->log, LogLevel::warning,
             "ferry[rank %d]: loaded %llu tensors of step %llu from %s; %zu checkpoint "
             "tensors not restored: %s",
             im.ctx->rank, static_cast<unsigned long long>(r.tensors_restored),
             static_cast<unsigned long long>(r.step), r.path.c_str(), r.not_restored.size(),
             keys.c_str());
}

// Rank 0 decides which checkpoint `path` names and reads its manifest once
// per `id`, for every rank: all ranks get the same step even while another
// save commits.
LoadReplyMsg resolve_on_rank0(Runtime::Impl& im, caf::scoped_actor& self, const std::string& id,
                              const std::string& path) {
  const Options& o = im.ctx->opts;
  LoadRequestMsg req{im.ctx->job_id, id, im.ctx->rank, path};
  coordinator_api resolver = rank0_api(im);
  LoadReplyMsg reply;
  // Rank 0 only reads a manifest and the link has its own deadline: this
  // bound is the last resort against an answer that never comes.
  self->request(resolver, millis(o.commit_timeout_s + o.heartbeat_timeout_s + 10), atom::resolve_v,
                std::move(req))
      .receive([&](const LoadReplyMsg& r) { reply = r; },
               [&](caf::error& e) { reply.status = from_caf(self, e, "load: resolving " + path); });
  return reply;
}

}  // namespace

Result<LoadReport> Runtime::resolve(const std::string& path) {
  Impl& im = *impl_;
  caf::scoped_actor self{*im.sys};
  LoadReplyMsg reply = resolve_on_rank0(im, self, "resolve-" + std::to_string(++im.resolves), path);
  if (!reply.status.ok()) return reply.status;
  FERRY_ASSIGN_OR_RETURN(ManifestSummary m, summarize_manifest(reply.manifest));
  LoadReport out;
  out.path = reply.dir;
  out.step = m.step;
  return out;
}

Result<LoadReport> Runtime::load_report(StateDict& sd, const std::string& path) {
  Impl& im = *impl_;
  const std::string id = "load-" + std::to_string(++im.loads);
  im.ctx->hold_root(path);
  std::optional<LoadTimes> times;
  if (!im.ctx->opts.trace_dir.empty()) times.emplace().start = trace_now_ns();
  caf::scoped_actor self{*im.sys};
  LoadReplyMsg reply = resolve_on_rank0(im, self, id, path);
  if (times) times->resolved = trace_now_ns();
  LoadReport report;
  if (im.transport) im.transport->take_queued_peak();
  im.ctx->shares->take_relayed();
  im.ctx->shares->take_in_memory();
  Status s = load_local(im, self, sd, id, reply, &report, times ? &*times : nullptr);
  // Every rank reports, failed or not: a rank that skipped the round trip
  // would leave the others waiting for it.
  if (im.ctx->world_size > 1 || times)
    s = collective_outcome(im, self, id, s, times ? load_trace(*im.ctx, *times) : RankTrace{});
  if (im.transport) report.send_queue_peak = im.transport->take_queued_peak();
  report.share_frames_relayed = im.ctx->shares->take_relayed();
  report.shared_in_memory = im.ctx->shares->take_in_memory();
  if (!s.ok()) return s;
  return report;
}

Status Runtime::load(StateDict& sd, const std::string& path) {
  auto r = load_report(sd, path);
  if (!r.ok()) return r.status();
  log_not_restored(*impl_, *r);
  return Status();
}

std::string Runtime::latest(const std::string& root) const {
  if (!root.empty()) impl_->ctx->hold_root(root);
  auto r = find_latest(*impl_->ctx->fs, root.empty() ? impl_->ctx->opts.root : root,
                       impl_->ctx->manifests.get());
  return r.ok() ? r->path : "";
}

std::string Runtime::latest_valid(const std::string& root) const {
  if (!root.empty()) impl_->ctx->hold_root(root);
  auto r = ferry::latest_valid(*impl_->ctx->fs, root.empty() ? impl_->ctx->opts.root : root);
  return r.ok() ? r->path : "";
}

const Options& Runtime::options() const {
  return impl_->ctx->opts;
}
int32_t Runtime::rank() const {
  return impl_->ctx->rank;
}
int32_t Runtime::world_size() const {
  return impl_->ctx->world_size;
}

}  // namespace ferry
