// SavePlanner (ferry/planner.hpp): save_async's save, stopped after the plan
// and after the write until the caller takes the next step.

#include <filesystem>
#include <system_error>
#include <utility>

#include "actors/runtime_access.hpp"
#include "actors/save_state.hpp"
#include "catalog.hpp"
#include "ferry/planner.hpp"
#include "planner_api.hpp"

namespace ferry {

using detail::RuntimeAccess;

// --- WriteHandle -------------------------------------------------------------------

namespace {
Status written_status(const detail::SaveState& s) {
  return s.done && !s.status.ok() ? s.status : Status();
}
}  // namespace

Status WriteHandle::wait() const {
  if (!s_) return Status::invalid_argument("empty WriteHandle");
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait(lock, [this] { return s_->written || s_->done; });
  return written_status(*s_);
}

Status WriteHandle::wait(std::chrono::milliseconds timeout) const {
  if (!s_) return Status::invalid_argument("empty WriteHandle");
  std::unique_lock<std::mutex> lock(s_->mu);
  if (!s_->cv.wait_for(lock, timeout, [this] { return s_->written || s_->done; }))
    return Status::timeout("this rank's files of step " + std::to_string(s_->step) +
                           " are not durable after " + std::to_string(timeout.count()) + " ms");
  return written_status(*s_);
}

bool WriteHandle::done() const {
  if (!s_) return true;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->written || s_->done;
}

// --- SavePlanner -------------------------------------------------------------------

// Not part of the ABI: without this it would share SavePlanner's exported visibility.
struct __attribute__((visibility("hidden"))) SavePlanner::Impl {
  Runtime& rt;
  StateDict sd;
  SavePlannerOptions opts;
  std::string root;
  uint64_t step = 0;
  // A constructor argument was bad or the local plan failed: every step
  // returns it, and the checkpoint is aborted on every rank (`save`).
  Status broken;
  std::optional<LocalPlan> local;
  std::shared_ptr<detail::SaveState> save;
  std::vector<SavePlan> global;
  bool writing = false;

  Impl(Runtime& r, const StateDict& s) : rt(r), sd(s) {}

  void abandon(Status why) {
    RuntimeAccess::proceed(rt, Proceed{save, Proceed::abandon, std::move(why)});
  }

  // This rank cannot take part: the others hear it from rank 0 now instead
  // of waiting for its plan until plan-timeout.
  Status fail_everywhere(Status why) {
    broken = why;
    if (!save) save = RuntimeAccess::start_doomed_save(rt, step, why);
    return why;
  }
};

namespace {

// As PlanRequest carries it: 0 leaves it to rank 0's configuration.
uint8_t policy_code(const std::optional<OwnerPolicy>& p) {
  if (!p) return 0;
  return *p == OwnerPolicy::balanced ? 1 : 2;
}

std::shared_ptr<detail::SaveState> failed_save(uint64_t step, Status why) {
  auto s = std::make_shared<detail::SaveState>();
  s->step = step;
  s->finish(why, "");
  return s;
}

}  // namespace

// The constructor's arguments, each error naming the one that is wrong.
// The save checks the file options again; checked here so that a bad one
// fails this checkpoint on every rank at once.
static Status check_arguments(const Runtime& rt, const StateDict& sd, std::string filename_prefix,
                              SavePlanner::Impl& im) {
  if (im.root.empty() && !filename_prefix.empty()) {
    // No root anywhere: the prefix says where the files go, as DCP's
    // filename_prefix does ("ckpt/model": root ckpt, files model-*; a bare
    // name: the working directory).
    const size_t slash = filename_prefix.rfind('/');
    std::string dir = slash == std::string::npos ? "" : filename_prefix.substr(0, slash + 1);
    filename_prefix =
        slash == std::string::npos ? filename_prefix : filename_prefix.substr(slash + 1);
    if (filename_prefix.empty())
      return Status::invalid_argument("SavePlanner filename_prefix '" + dir +
                                      "' ends in '/': no file prefix after the directory");
    std::error_code ec;
    std::filesystem::path where =
        dir.empty() ? std::filesystem::current_path(ec) : std::filesystem::absolute(dir, ec);
    if (ec)
      return Status::io_error("SavePlanner: the directory of filename_prefix '" + dir +
                              "': " + ec.message());
    im.root = where.lexically_normal().string();
    while (im.root.size() > 1 && im.root.back() == '/') im.root.pop_back();
    im.opts.save.root = im.root;
  }
  if (!filename_prefix.empty()) {
    FERRY_RETURN_IF_ERROR(check_filename_prefix(filename_prefix, "SavePlanner filename_prefix"));
    im.opts.save.filename_prefix = filename_prefix;
  }
  if (im.root.empty())
    return Status::invalid_argument(
        "SavePlanner: no checkpoint root: pass one, set ferry.root, or give a filename_prefix");
  if (sd.entries().empty())
    return Status::invalid_argument("SavePlanner: the state dict is empty (nothing to save)");
  return RuntimeAccess::resolve_file_options(rt, im.opts.save,
                                             static_cast<bool>(im.opts.checkpoint_fn))
      .status()
      .with_context("SavePlanner: ");
}

SavePlanner::SavePlanner(Runtime& rt, const StateDict& sd, std::string filename_prefix,
                         SavePlannerOptions options, std::string root, std::optional<uint64_t> step)
    : impl_(std::make_unique<Impl>(rt, sd)) {
  Impl& im = *impl_;
  im.opts = std::move(options);
  im.root = !root.empty()                ? root
            : !im.opts.save.root.empty() ? im.opts.save.root
                                         : rt.options().root;
  im.opts.save.root = im.root;
  Status bad = check_arguments(rt, sd, filename_prefix, im);
  if (bad.ok() && step) {
    im.step = *step;
  } else if (bad.ok()) {
    // One more than the latest committed step; every rank reads the same
    // root, and a rank that saw another commit than the others is refused
    // at plan time (the ranks disagree on the step).
    const RankContext& ctx = RuntimeAccess::context(rt);
    auto latest = find_latest(*ctx.fs, im.root, ctx.manifests.get());
    if (latest.ok()) {
      im.step = latest->step + 1;
    } else if (latest.status().code() != StatusCode::not_found) {
      bad = latest.status().with_context("SavePlanner: finding the latest step under " + im.root +
                                         ": ");
    }
  }
  if (!bad.ok()) (void)im.fail_everywhere(bad);  // kept in `broken`: every later call returns it
}

SavePlanner::~SavePlanner() {
  Impl& im = *impl_;
  // Left unfinished, the save would hold the planner (and every other rank)
  // until write-timeout: end it now, on every rank.
  if (im.save && !SaveHandle(im.save).done())
    im.abandon(Status::aborted("rank " + std::to_string(im.rt.rank()) +
                               " dropped its SavePlanner before barrier()"));
}

uint64_t SavePlanner::step() const {
  return impl_->step;
}

SaveHandle SavePlanner::handle() const {
  return SaveHandle(impl_->save);
}

Result<LocalSavePlan> SavePlanner::create_local_plan() {
  Impl& im = *impl_;
  if (!im.broken.ok()) return im.broken;
  if (!im.local) {
    auto original = make_local_plan(im.sd, im.rt.rank());
    if (!original.ok()) return im.fail_everywhere(original.status());
    LocalSavePlan pub = to_public(*original);
    if (im.opts.transform_local_plan) {
      Status s = im.opts.transform_local_plan(pub);
      if (!s.ok()) return im.fail_everywhere(s.with_context("transform_local_plan: "));
      s = check_transformed(*original, pub);
      if (!s.ok()) return im.fail_everywhere(s.with_context("transform_local_plan: "));
    }
    im.local = to_internal(pub);
  }
  return to_public(*im.local);
}

Result<std::vector<SavePlan>> SavePlanner::create_global_plan() {
  Impl& im = *impl_;
  if (!im.broken.ok()) return im.broken;
  if (im.save)
    return Status::invalid_argument(
        "create_global_plan() was already called: one SavePlanner makes one checkpoint");
  FERRY_RETURN_IF_ERROR(create_local_plan().status());
  im.save = RuntimeAccess::start_save(im.rt, im.sd, im.step, im.opts.save, im.local, true,
                                      im.opts.checkpoint_fn, policy_code(im.opts.owner_policy));
  std::unique_lock<std::mutex> lock(im.save->mu);
  im.save->cv.wait(lock, [&] { return im.save->planned || im.save->done; });
  if (im.save->done) return im.save->status;
  auto all = decode_save_plans(im.save->all_plans);
  lock.unlock();
  if (!all.ok()) {
    im.abandon(all.status().with_context("the global plan from rank 0: "));
    return all.status();
  }
  im.global = std::move(all).value();
  return im.global;
}

WriteHandle SavePlanner::save_on_this_process(const SavePlan& plan) {
  Impl& im = *impl_;
  const int32_t me = im.rt.rank();
  if (!im.broken.ok()) return WriteHandle(failed_save(im.step, im.broken));
  if (!im.save || im.global.empty())
    return WriteHandle(failed_save(
        im.step,
        Status::invalid_argument("save_on_this_process(): call create_global_plan() first")));
  if (plan.rank != me)
    return WriteHandle(failed_save(
        im.step,
        Status::invalid_argument("save_on_this_process() on rank " + std::to_string(me) +
                                 " got rank " + std::to_string(plan.rank) +
                                 "'s plan: each rank saves only its own (global_plan[rank])")));
  if (static_cast<size_t>(me) >= im.global.size() || plan.to_bytes() != im.global[me].to_bytes())
    return WriteHandle(failed_save(
        im.step,
        Status::invalid_argument("save_on_this_process() on rank " + std::to_string(me) +
                                 ": the plan differs from this rank's part of the global plan "
                                 "create_global_plan() returned")));
  if (im.writing) return WriteHandle(im.save);
  im.writing = true;
  RuntimeAccess::proceed(im.rt, Proceed{im.save, Proceed::write, {}});
  return WriteHandle(im.save);
}

Result<std::string> SavePlanner::barrier() {
  return barrier(std::chrono::milliseconds::max());
}

Result<std::string> SavePlanner::barrier(std::chrono::milliseconds timeout) {
  Impl& im = *impl_;
  if (!im.broken.ok()) return im.broken;
  if (!im.save)
    return Status::invalid_argument("barrier(): no checkpoint: call create_global_plan() first");
  if (!im.writing) {
    Status why = Status::invalid_argument(
        "rank " + std::to_string(im.rt.rank()) +
        " called barrier() before save_on_this_process(): its files were never written");
    im.abandon(why);
  } else {
    RuntimeAccess::proceed(im.rt, Proceed{im.save, Proceed::commit, {}});
  }
  SaveHandle h(im.save);
  Status s =
      timeout == std::chrono::milliseconds::max() ? h.wait_committed() : h.wait_committed(timeout);
  if (!s.ok()) return s;
  return h.path();
}

}  // namespace ferry
