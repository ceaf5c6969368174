// Small helpers shared by the tests: a scratch directory removed at the end,
// and a way for a test that cannot run here to say so.
#pragma once

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <string>

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

}  // namespace ferry::testing
