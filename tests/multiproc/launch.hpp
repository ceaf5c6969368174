// Starting a multi-rank job the way a user does (`ferry launch` running
// ferry_rank_worker) and reading what its ranks printed; shared by the
// multiproc test files.
#pragma once

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <array>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace ferry::testing {

struct LaunchRun {
  int code = -1;  // the launcher's exit code: 0 only when every rank exited 0
  std::string out;
  double seconds = 0;
};

// `env` prefixes the command (VAR=value ...); `grace` is how long the
// launcher waits for the other ranks once one has failed.
inline LaunchRun launch(int n, const std::string& worker_args, const std::string& env = "",
                        int grace = 20) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string cmd = env + " " + FERRY_CLI_PATH + " launch -n " + std::to_string(n) +
                          " --grace " + std::to_string(grace) + " -- " + FERRY_RANK_WORKER_PATH +
                          " " + worker_args + " 2>&1";
  LaunchRun r;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf;
  size_t got;
  while ((got = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

inline size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// The lines of `out` that contain `what`.
inline std::vector<std::string> lines_with(const std::string& out, const std::string& what) {
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin < out.size()) {
    size_t end = out.find('\n', begin);
    if (end == std::string::npos) end = out.size();
    std::string line = out.substr(begin, end - begin);
    if (line.find(what) != std::string::npos) lines.push_back(std::move(line));
    begin = end + 1;
  }
  return lines;
}

}  // namespace ferry::testing
