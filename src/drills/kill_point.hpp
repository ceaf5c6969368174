// Named kill points: places in the save protocol where a test can make this
// process SIGKILL itself, to prove that a crash at any step leaves either the
// new checkpoint complete or the previous one intact.
//
//   FERRY_KILL_AT=<point>[:<nth>][@<rank>][!stop]
//
// kills the process the nth time (default 1st) its runtime passes <point>,
// only on <rank> when given (every rank of a job inherits the variable); with
// !stop it SIGSTOPs itself instead, a rank that hangs at that step.
//
// The core and the actors only announce the points they pass
// (Filesystem::crash_point, a no-op by default); a KillPointFilesystem
// wrapped around a runtime's filesystem is what crashes there. It holds its
// own spec and count: two runtimes in one process never share them.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"

namespace ferry {

// Who passes a kill point: every rank of a job, or rank 0 alone (the
// coordinator: pending directory, manifest, commit, retention, a save's gc).
enum class KillPointRoles { every_rank, rank0 };

// Every kill point, in protocol order, with what happened just before it
// and who passes it (tests/multiproc/kill_points_test.cpp kills each role).
struct KillPointInfo {
  const char* name;
  const char* where;
  KillPointRoles roles;
};
const std::vector<KillPointInfo>& kill_points();

// A parsed FERRY_KILL_AT value.
struct KillSpec {
  std::string point;
  long nth = 1;
  int rank = -1;   // any
  int signal = 0;  // SIGKILL, or SIGSTOP with !stop
};

// Parses a FERRY_KILL_AT value; errors name the bad part (checked at start
// so a typo fails loudly instead of never firing).
Result<KillSpec> parse_kill_spec(const std::string& spec);
Status check_kill_spec(const std::string& spec);

// Forwards everything to its target and raises the spec's signal the nth
// time `crash_point(spec.point)` is called, when `rank` is the spec's.
class KillPointFilesystem : public FilesystemWrapper {
 public:
  KillPointFilesystem(std::shared_ptr<Filesystem> target, KillSpec spec, int rank);
  void crash_point(const char* point) override;

 private:
  const KillSpec spec_;
  const bool mine_;  // the spec names this rank, or any
  std::atomic<long> hits_{0};
};

// `base` wrapped to crash at `spec` (FERRY_KILL_AT's syntax) on `rank`.
Result<std::shared_ptr<Filesystem>> kill_point_filesystem(std::shared_ptr<Filesystem> base,
                                                          const std::string& spec, int rank);

// kill_point_filesystem with FERRY_KILL_AT's value; `base` itself when the
// variable is unset or empty. A bad value is an error naming the variable.
Result<std::shared_ptr<Filesystem>> kill_points_from_env(std::shared_ptr<Filesystem> base,
                                                         int rank);

}  // namespace ferry
