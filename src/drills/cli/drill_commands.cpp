// The CLI's drill commands (kill-points, power-cut): part of the `ferry`
// executable, kept beside the drills so that tools/ includes only the public
// headers.
#include <cstdio>

#include "drills/fault_fs.hpp"
#include "drills/kill_point.hpp"
#include "tools/commands.hpp"

namespace ferry::cli {

int cmd_kill_points(const Args&) {
  std::printf(
      "Kill points (FERRY_KILL_AT=<point>[:<nth>][@<rank>][!stop] SIGKILLs, or SIGSTOPs, "
      "there):\n");
  for (const auto& k : kill_points())
    std::printf("  %-18s %-10s %s\n", k.name,
                k.roles == KillPointRoles::rank0 ? "rank 0" : "any rank", k.where);
  return 0;
}

int cmd_power_cut(const Args& args) {
  if (int rc = need_one(args, "JOURNAL (the journal= file of FERRY_FAULTS)")) return rc;
  Status s = FaultFilesystem::apply_power_cut_from_journal(*posix_filesystem(), args[0]);
  if (!s.ok()) {
    std::fprintf(stderr, "ferry power-cut: %s\n", s.to_string().c_str());
    return 1;
  }
  std::printf("applied the power cut recorded in %s\n", args[0].c_str());
  return 0;
}

}  // namespace ferry::cli
