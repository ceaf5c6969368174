// The CLI's drill commands (kill-points, power-cut): part of the `ferry`
// executable, kept beside the drills so that tools/ includes only the public
// headers.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "drills/fault_fs.hpp"
#include "drills/kill_point.hpp"
#include "tools/commands.hpp"

namespace ferry::cli {

namespace {

int run_kill_points() {
  std::printf(
      "Kill points (FERRY_KILL_AT=<point>[:<nth>][@<rank>][!stop] SIGKILLs, or SIGSTOPs, "
      "there):\n");
  for (const auto& k : kill_points())
    std::printf("  %-18s %-10s %s\n", k.name,
                k.roles == KillPointRoles::rank0 ? "rank 0" : "any rank", k.where);
  return 0;
}

int run_power_cut(const std::string& journal) {
  Status s = FaultFilesystem::apply_power_cut_from_journal(*posix_filesystem(), journal);
  if (!s.ok()) {
    std::fprintf(stderr, "ferry power-cut: %s\n", s.to_string().c_str());
    return 1;
  }
  std::printf("applied the power cut recorded in %s\n", journal.c_str());
  return 0;
}

}  // namespace

void add_drill_commands(CLI::App& app, int* rc) {
  CLI::App* kill =
      app.add_subcommand("kill-points", "the named kill points of FERRY_KILL_AT (crash tests)");
  kill->footer("Lists the kill points FERRY_KILL_AT=<point>[:<nth>][@<rank>][!stop] accepts.");
  kill->callback([rc] { *rc = run_kill_points(); });

  auto journal = std::make_shared<std::string>();
  CLI::App* cut =
      app.add_subcommand("power-cut", "drop what a FERRY_FAULTS journal says was not durable");
  cut->add_option("JOURNAL", *journal, "the journal= file of FERRY_FAULTS")
      ->required()
      ->type_name("");
  cut->footer(
      "Applies the power-cut model to what the FERRY_FAULTS journal JOURNAL recorded: drops\n"
      "what was not durable.");
  cut->callback([rc, journal] { *rc = run_power_cut(*journal); });
}

}  // namespace ferry::cli
