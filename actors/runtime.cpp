// The Runtime facade (declared in src/include/ferry/runtime.hpp): owns the
// actor system of this process and the objects built once at start.

#include "ferry/runtime.hpp"

#include <cstdlib>
#include <fstream>

#include "actors/actors.hpp"
#include "actors/messages.hpp"
#include "ferry/catalog.hpp"

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

uint64_t SaveHandle::step() const { return s_ ? s_->step : 0; }

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

uint64_t SaveHandle::bytes_persisted() const { return s_ ? s_->bytes_persisted.load() : 0; }
uint64_t SaveHandle::bytes_total() const { return s_ ? s_->bytes_total.load() : 0; }

// --- Runtime -----------------------------------------------------------------------

struct Runtime::Impl {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::shared_ptr<RankContext> ctx;
  caf::actor coordinator;
  caf::actor planner;
  caf::actor loader;
  std::mutex mu;  // serializes save_async callers
  std::shared_ptr<detail::SaveState> last;
};

namespace {

// A job id safe inside a directory name.
std::string job_id_from_env() {
  for (const char* var : {"FERRY_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"}) {
    const char* v = std::getenv(var);
    if (v && *v) {
      std::string id;
      for (const char* p = v; *p && id.size() < 32; ++p)
        id.push_back(std::isalnum(static_cast<unsigned char>(*p)) || *p == '_' ? *p : '_');
      return id;
    }
  }
  return "local";
}

std::string config_file_from(const RuntimeArgs& args) {
  if (!args.config_file.empty()) return args.config_file;
  const std::string flag = "--config-file=";
  for (const auto& a : args.argv)
    if (a.compare(0, flag.size(), flag) == 0) return a.substr(flag.size());
  return "";
}

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

}  // namespace

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Runtime>> Runtime::create(RuntimeArgs args) {
  const std::string config_file = config_file_from(args);
  FERRY_ASSIGN_OR_RETURN(Options opts, load_options(args.settings, config_file));
  if (args.world_size < 1 || args.rank < 0 || args.rank >= args.world_size)
    return Status::invalid_argument("rank " + std::to_string(args.rank) + " outside world size " +
                                    std::to_string(args.world_size));
  if (args.world_size > 1)
    return Status::unsupported("world size " + std::to_string(args.world_size) +
                               ": this build saves from one rank only");

  auto impl = std::make_unique<Impl>();
  // Ferry is a guest in the training process: a few scheduler threads are
  // plenty for message passing (blocking I/O has its own threads).
  impl->cfg.set("scheduler.max-threads", 2);
  impl->cfg.set("logger.console-verbosity", caf::atom("quiet"));
  std::vector<std::string> caf_args;
  for (const auto& a : args.argv)
    if (a.rfind("--config-file=", 0) != 0) caf_args.push_back(a);
  std::string ini = config_file;
  if (ini.empty()) {
    std::ifstream probe("caf-application.ini");
    if (probe) ini = "caf-application.ini";
  }
  if (auto err = impl->cfg.parse(caf_args, ini.empty() ? nullptr : ini.c_str()))
    return Status::invalid_argument("actor system config: " + caf::to_string(err));

  auto ctx = std::make_shared<RankContext>();
  ctx->opts = opts;
  ctx->rank = args.rank;
  ctx->world_size = args.world_size;
  ctx->job_id = job_id_from_env();
  ctx->fs = args.fs ? args.fs : posix_filesystem();
  ctx->device = args.device ? args.device : host_device();
  FERRY_ASSIGN_OR_RETURN(auto pool, StagingPool::create(opts.pool_bytes, opts.chunk_bytes));
  ctx->pool = std::move(pool);
  impl->ctx = ctx;

  impl->sys = std::make_unique<caf::actor_system>(impl->cfg);
  if (args.rank == 0) impl->coordinator = spawn_coordinator(*impl->sys, ctx);
  impl->planner = spawn_planner(*impl->sys, ctx, impl->coordinator);
  impl->loader = spawn_loader(*impl->sys, ctx);
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

Result<std::unique_ptr<Runtime>> Runtime::from_env(RuntimeArgs args) {
  FERRY_ASSIGN_OR_RETURN(args.rank, env_int("RANK", 0));
  FERRY_ASSIGN_OR_RETURN(args.world_size, env_int("WORLD_SIZE", 1));
  return create(std::move(args));
}

Runtime::~Runtime() {
  if (!impl_) return;
  std::shared_ptr<detail::SaveState> last;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    last = impl_->last;
  }
  // A bounded wait: a save stuck on storage must not hang the process exit.
  if (last) {
    std::unique_lock<std::mutex> lock(last->mu);
    last->cv.wait_for(lock, std::chrono::seconds(60), [&] { return last->done; });
  }
  impl_->ctx->pool->set_release_hook(nullptr);
  // Detached actors' threads wait until nothing refers to their actor, so
  // drop our handles before the system waits for them.
  for (auto* a : {&impl_->planner, &impl_->coordinator, &impl_->loader}) {
    if (*a) caf::anon_send_exit(*a, caf::exit_reason::user_shutdown);
    *a = caf::actor();
  }
  impl_->sys.reset();
}

SaveHandle Runtime::save_async(const StateDict& sd, uint64_t step, const SaveOptions& opts) {
  const auto t0 = detail::SaveState::clock::now();
  auto state = std::make_shared<detail::SaveState>();
  state->step = step;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (auto prev = impl_->last) {
      std::unique_lock<std::mutex> plock(prev->mu);
      if (!prev->snapshot_done) {
        if (impl_->ctx->opts.fail_fast) {
          plock.unlock();
          state->finish(Status::busy("save of step " + std::to_string(step) +
                                     " refused: the save of step " + std::to_string(prev->step) +
                                     " is still taking its snapshot (fail-fast is on)"),
                        "");
          return SaveHandle(state);
        }
        prev->cv.wait(plock, [&] { return prev->snapshot_done; });
      }
    }
    impl_->last = state;
  }
  std::string root = opts.root.empty() ? impl_->ctx->opts.root : opts.root;
  if (root.empty()) {
    state->finish(Status::invalid_argument("no checkpoint root: set ferry.root or SaveOptions::root"),
                  "");
    return SaveHandle(state);
  }
  state->started = t0;
  caf::anon_send(impl_->planner, atom::save_v, SaveJob{sd, step, opts, root, state});
  const double ms =
      std::chrono::duration<double, std::milli>(detail::SaveState::clock::now() - t0).count();
  state->update_metrics([ms](SaveMetrics& m) { m.save_async_ms = ms; });
  return SaveHandle(state);
}

Status Runtime::load(StateDict& sd, const std::string& path) {
  if (path.empty()) return Status::not_found("no checkpoint to load (empty path)");
  Filesystem& fs = *impl_->ctx->fs;
  std::string base = path;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  base = base.substr(base.find_last_of('/') + 1);
  // A pending directory may hold a complete-looking MANIFEST copy (a crash
  // after the manifest write, before the rename): never load one.
  if (is_pending_dir_name(base))
    return Status::invalid_argument(path + " is a pending (uncommitted) checkpoint");
  std::string dir = path;
  if (!fs.stat(join_path(path, kManifestFileName)).ok()) {
    auto latest = find_latest(fs, path);
    if (!latest.ok()) return Status::not_found("no committed checkpoint at " + path);
    dir = latest->path;
  }
  auto m = read_manifest(fs, dir);
  if (!m.ok()) return m.status();
  auto manifest = std::make_shared<const Manifest>(std::move(m).value());
  FERRY_ASSIGN_OR_RETURN(auto requests, make_load_requests(sd));
  LoadPlanOptions lo;
  lo.max_read_bytes = impl_->ctx->opts.chunk_bytes;
  FERRY_ASSIGN_OR_RETURN(auto ops, make_load_plan(*manifest, requests, lo));
  LoadJob job{dir, manifest, std::move(ops), {}};
  for (const auto& e : sd.entries()) job.targets.push_back(e.view);

  Status result;
  caf::scoped_actor self{*impl_->sys};
  self->request(impl_->loader, caf::infinite, atom::load_v, std::move(job))
      .receive([&](const Status& s) { result = s; },
               [&](caf::error& e) { result = Status::internal("load: " + self->system().render(e)); });
  return result.with_context(result.ok() ? "" : "load " + dir + ": ");
}

std::string Runtime::latest(const std::string& root) const {
  auto r = find_latest(*impl_->ctx->fs, root.empty() ? impl_->ctx->opts.root : root);
  return r.ok() ? r->path : "";
}

const Options& Runtime::options() const { return impl_->ctx->opts; }
int32_t Runtime::rank() const { return impl_->ctx->rank; }
int32_t Runtime::world_size() const { return impl_->ctx->world_size; }

}  // namespace ferry
