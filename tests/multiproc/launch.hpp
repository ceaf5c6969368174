// Starting a multi-rank job the way a user does (`ferry launch` running
// ferry_rank_worker) and reading what its ranks printed; shared by the
// multiproc test files.
#pragma once

#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "catalog.hpp"
#include "process.hpp"

namespace ferry::testing {

using LaunchRun = RunResult;  // code is 0 only when every rank exited 0

// `env` prefixes the command line (VAR=value ...); `grace` is how long the
// launcher waits for the other ranks once one has failed.
inline LaunchRun launch(int n, const std::string& worker_args, const std::string& env = "",
                        int grace = 20) {
  return run_shell(env + " " + FERRY_CLI_PATH + " launch -n " + std::to_string(n) + " --grace " +
                   std::to_string(grace) + " -- " + FERRY_RANK_WORKER_PATH + " " + worker_args);
}

inline size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// The lines of `out` that contain `what`.
inline std::vector<std::string> lines_with(const std::string& out, const std::string& what) {
  std::vector<std::string> lines;
  for (std::string& line : lines_of(out))
    if (line.find(what) != std::string::npos) lines.push_back(std::move(line));
  return lines;
}

// Launches `n` ranks that save (`args`: the worker's step, seed and model
// flags) into `root`; the step directory of the checkpoint they committed.
inline std::string save_latest(int n, const std::string& args, const std::string& root) {
  const LaunchRun saved = launch(n, "--mode save --root " + root + " " + args);
  INFO(saved.out);
  REQUIRE(saved.code == 0);
  auto latest = find_latest(*posix_filesystem(), root);
  REQUIRE(latest.ok());
  return latest->path;
}

// Launches `n` ranks that load the latest checkpoint of `root` (`args`: the
// worker's seed and layout flags) and checks that each found every byte equal.
inline void check_loads(int n, const std::string& args, const std::string& root) {
  INFO("load into " << n << " ranks: " << args);
  const LaunchRun l = launch(n, "--mode load " + args + " --root " + root);
  INFO(l.out);
  CHECK(l.code == 0);
  CHECK(count(l.out, "every byte equal") == static_cast<size_t>(n));
}

// What a failed save must leave in `root`: no checkpoint and no pending
// directory.
inline void check_nothing_saved(const std::string& root) {
  INFO("root " << root);
  CHECK(list_checkpoints(*posix_filesystem(), root)->empty());
  for (const auto& e : std::filesystem::directory_iterator(root))
    CHECK_FALSE(is_pending_dir_name(e.path().filename().string()));
}

}  // namespace ferry::testing
