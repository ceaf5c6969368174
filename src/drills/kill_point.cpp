#include "drills/kill_point.hpp"

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <mutex>

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

struct Spec {
  std::string point;
  long nth = 1;
  int rank = -1;  // any
  int signal = SIGKILL;
};

bool parse(const std::string& s, Spec* out, std::string* why) {
  Spec sp;
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

std::atomic<int> g_rank{0};
std::atomic<bool> g_armed{false};
std::once_flag g_once;
Spec g_spec;
std::atomic<long> g_hits{0};

void arm() {
  const char* v = std::getenv("FERRY_KILL_AT");
  if (!v || !*v) return;
  std::string why;
  if (parse(v, &g_spec, &why)) g_armed = true;
}

}  // namespace

void set_kill_point_rank(int rank) {
  g_rank = rank;
}

Status check_kill_spec(const std::string& spec) {
  Spec sp;
  std::string why;
  if (!parse(spec, &sp, &why)) return Status::invalid_argument("FERRY_KILL_AT: " + why);
  return Status();
}

Status arm_kill_point(const std::string& spec) {
  std::call_once(g_once, arm);  // so that a later first pass does not re-arm from the env
  Spec sp;
  std::string why;
  if (!parse(spec, &sp, &why)) return Status::invalid_argument("kill point: " + why);
  g_spec = sp;
  g_hits = 0;
  g_armed = true;
  return Status();
}

void kill_point(const char* name) {
  std::call_once(g_once, arm);
  if (!g_armed.load(std::memory_order_relaxed)) return;
  if (g_spec.point != name) return;
  if (g_spec.rank >= 0 && g_spec.rank != g_rank.load()) return;
  if (g_hits.fetch_add(1) + 1 == g_spec.nth) std::raise(g_spec.signal);
}

}  // namespace ferry
