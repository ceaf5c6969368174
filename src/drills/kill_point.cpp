#include "drills/kill_point.hpp"

#include <csignal>
#include <cstdlib>

namespace ferry {

const std::vector<KillPointInfo>& kill_points() {
  using R = KillPointRoles;
  static const std::vector<KillPointInfo> kPoints = {
      {"plan.sent", "a rank sent its local plan", R::every_rank},
      {"plan.received", "a rank received its part of the global plan", R::every_rank},
      {"pending.created", "rank 0 created the pending directory", R::rank0},
      {"writer.open", "a writer created a data file", R::every_rank},
      {"writer.write", "a writer wrote a block", R::every_rank},
      {"writer.fsync", "a writer fsynced a data file", R::every_rank},
      {"writer.close", "a writer closed a data file", R::every_rank},
      {"writer.report", "a rank is about to send its write result", R::every_rank},
      {"manifest.write", "rank 0 wrote MANIFEST's temp file", R::rank0},
      {"manifest.fsync", "rank 0 fsynced MANIFEST's temp file", R::rank0},
      {"manifest.rename", "rank 0 renamed MANIFEST into place", R::rank0},
      {"manifest.dirsync", "rank 0 fsynced the pending directory after MANIFEST", R::rank0},
      {"latest.write", "rank 0 wrote LATEST's temp file (before the commit point)", R::rank0},
      {"latest.fsync", "rank 0 fsynced LATEST's temp file", R::rank0},
      {"overwrite.aside", "rank 0 moved the old step-N aside to overwrite it", R::rank0},
      {"commit.rename", "rank 0 renamed the pending directory to step-N (the commit point)",
       R::rank0},
      {"latest.rename", "rank 0 renamed LATEST into place", R::rank0},
      {"root.fsync", "rank 0 fsynced ROOT after the commit and LATEST renames", R::rank0},
      {"retention.delete", "retention moved an old checkpoint aside to delete it", R::rank0},
      {"gc.delete", "gc took a directory out of sight and is about to delete it", R::rank0},
      {"load.read", "a load's reader read a run, before it sends shared bytes on", R::every_rank},
      {"load.receive", "a load's loader got shared bytes from another rank, before it takes them",
       R::every_rank},
  };
  return kPoints;
}

namespace {

bool parse(const std::string& s, KillSpec* out, std::string* why) {
  KillSpec sp;
  sp.signal = SIGKILL;
  std::string rest = s;
  // "!stop": SIGSTOP, a process that hangs right there instead of dying.
  if (auto bang = rest.find('!'); bang != std::string::npos) {
    if (rest.substr(bang + 1) != "stop") {
      *why = "bad signal in '" + s + "' (only !stop)";
      return false;
    }
    sp.signal = SIGSTOP;
    rest.resize(bang);
  }
  if (auto at = rest.find('@'); at != std::string::npos) {
    char* end = nullptr;
    sp.rank = static_cast<int>(std::strtol(rest.c_str() + at + 1, &end, 10));
    if (at + 1 == rest.size() || *end != '\0' || sp.rank < 0) {
      *why = "bad rank in '" + s + "'";
      return false;
    }
    rest.resize(at);
  }
  if (auto colon = rest.find(':'); colon != std::string::npos) {
    char* end = nullptr;
    sp.nth = std::strtol(rest.c_str() + colon + 1, &end, 10);
    if (colon + 1 == rest.size() || *end != '\0' || sp.nth < 1) {
      *why = "bad count in '" + s + "'";
      return false;
    }
    rest.resize(colon);
  }
  bool known = false;
  for (const auto& p : kill_points()) known = known || rest == p.name;
  if (!known) {
    *why = "unknown kill point '" + rest + "' (ferry kill-points lists them)";
    return false;
  }
  sp.point = rest;
  *out = sp;
  return true;
}

}  // namespace

Result<KillSpec> parse_kill_spec(const std::string& spec) {
  KillSpec sp;
  std::string why;
  if (!parse(spec, &sp, &why)) return Status::invalid_argument("FERRY_KILL_AT: " + why);
  return sp;
}

Status check_kill_spec(const std::string& spec) {
  return parse_kill_spec(spec).status();
}

KillPointFilesystem::KillPointFilesystem(std::shared_ptr<Filesystem> target, KillSpec spec,
                                         int rank)
    : FilesystemWrapper(std::move(target)),
      spec_(std::move(spec)),
      mine_(spec_.rank < 0 || spec_.rank == rank) {}

void KillPointFilesystem::crash_point(const char* point) {
  if (mine_ && spec_.point == point && hits_.fetch_add(1) + 1 == spec_.nth)
    std::raise(spec_.signal);
  target_->crash_point(point);
}

Result<std::shared_ptr<Filesystem>> kill_point_filesystem(std::shared_ptr<Filesystem> base,
                                                          const std::string& spec, int rank) {
  FERRY_ASSIGN_OR_RETURN(KillSpec sp, parse_kill_spec(spec));
  return std::shared_ptr<Filesystem>(
      std::make_shared<KillPointFilesystem>(std::move(base), std::move(sp), rank));
}

Result<std::shared_ptr<Filesystem>> kill_points_from_env(std::shared_ptr<Filesystem> base,
                                                         int rank) {
  const char* spec = std::getenv("FERRY_KILL_AT");
  if (spec == nullptr || *spec == '\0') return base;
  return kill_point_filesystem(std::move(base), spec, rank);
}

}  // namespace ferry
