// Shared by the libFuzzer harnesses in this directory: a per-input time limit
// finer than libFuzzer's -timeout (whole seconds), and a way to fail loudly.
#pragma once

#include <time.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ferry::fuzz {

// One decoder call on one input must finish well within this. CPU time of the
// calling thread is measured, not wall time, so that a loaded machine (other
// builds sharing the cores) does not abort a healthy run; a call that blocks
// instead of computing is caught by the wall-clock limit, then by -timeout.
constexpr double kInputCpuLimitMs = 100.0;
constexpr double kInputWallLimitMs = 1000.0;

inline double now_ms(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// Prints what went wrong and aborts: libFuzzer then saves the input as
// crash-<sha1> and reports it as a finding.
[[noreturn]] inline void fail(const char* target, const std::string& what) {
  std::fprintf(stderr, "\n%s: INVARIANT VIOLATED: %s\n", target, what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Runs the harness body on one input and aborts when it ran too long. A run
// over a limit is timed once more and is a finding only when it is over
// again: on a shared VM a thread's clock can stall past the limit for an
// input that takes a few milliseconds, while a slow input is slow every time.
inline int timed(const char* target, const uint8_t* data, size_t size,
                 int (*body)(const uint8_t*, size_t)) {
  for (int attempt = 0;; ++attempt) {
    const double cpu0 = now_ms(CLOCK_THREAD_CPUTIME_ID);
    const double wall0 = now_ms(CLOCK_MONOTONIC);
    const int rc = body(data, size);
    const double cpu = now_ms(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    const double wall = now_ms(CLOCK_MONOTONIC) - wall0;
    if (cpu <= kInputCpuLimitMs && wall <= kInputWallLimitMs) return rc;
    if (attempt == 1)
      fail(target, "one input of " + std::to_string(size) + " bytes took " + std::to_string(cpu) +
                       " ms of CPU (limit " + std::to_string(kInputCpuLimitMs) + "), " +
                       std::to_string(wall) + " ms of wall time (limit " +
                       std::to_string(kInputWallLimitMs) + "), twice in a row");
  }
}

}  // namespace ferry::fuzz
