// Small helpers shared by the tests: a scratch directory removed at the end,
// a way for a test that cannot run here to say so, a wait for what another
// thread makes true, and reproducible random bytes.
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace ferry::testing {

// Catch2 2.13 has no SKIP, and a test that returns early reads as passed.
// FERRY_SKIP(why) records the skip and ends the test case; the test main
// (tests/main.cpp) then exits with kSkipExitCode when nothing failed, which
// ctest (SKIP_RETURN_CODE, see tests/CMakeLists.txt) reports as skipped. ctest
// runs one test case per process, so the code belongs to that case alone.
constexpr int kSkipExitCode = 77;

inline bool& skip_recorded() {
  static bool skipped = false;
  return skipped;
}

#define FERRY_SKIP(why)                              \
  do {                                               \
    ::ferry::testing::skip_recorded() = true;        \
    WARN("SKIPPED: " << why); /* NOLINT: a stream */ \
    return;                                          \
  } while (false)

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/ferry-test-XXXXXX";
    path_ = mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Waits for a condition another thread makes true; false after 20 s, so that
// the test fails instead of hanging when it never does.
template <class Pred>
bool eventually(Pred p) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!p()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// Flips the bits of one byte of the file at `path` in place (a corrupt block).
inline void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
  REQUIRE(f.good());
}

// `n` bytes that depend only on `seed`.
inline std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

}  // namespace ferry::testing
