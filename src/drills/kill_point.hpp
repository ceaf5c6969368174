// Named kill points: places in the save protocol where a test can make this
// process SIGKILL itself, to prove that a crash at any step leaves either the
// new checkpoint complete or the previous one intact.
//
//   FERRY_KILL_AT=<point>[:<nth>][@<rank>][!stop]
//
// kills the process the nth time (default 1st) it passes <point>, only on
// <rank> when given (every rank of a job inherits the variable); with !stop
// it SIGSTOPs itself instead, a rank that hangs at that step. Unset, a
// kill point costs one relaxed atomic load. Part of the drills library
// (src/drills/kill_point.cpp), which the core's commit code calls into.
#pragma once

#include <string>
#include <vector>

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

// Passes the named point (which must be in kill_points()).
void kill_point(const char* name);

// The rank that `@rank` selectors compare with (set by the Runtime).
void set_kill_point_rank(int rank);

// Arms this process as FERRY_KILL_AT=`spec` would, replacing what the
// variable said (which is read once per process, so a forked child cannot
// arm itself through setenv). For tests that fork a child to crash in it.
// REQUIRES: no other thread is passing kill points.
Status arm_kill_point(const std::string& spec);

// Parses a FERRY_KILL_AT value; errors name the bad part (used at start so a
// typo fails loudly instead of never firing).
Status check_kill_spec(const std::string& spec);

}  // namespace ferry
