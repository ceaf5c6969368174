// The S3 server the suite started (tests/s3/s3server.sh, a ctest fixture):
// its endpoint and credentials come from the env file FERRY_S3_ENV names.
// Where it could not start, S3 tests skip naming why, and fail instead under
// FERRY_REQUIRE_S3=1 (which .ci/run sets).
#pragma once

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include <unistd.h>

#include "s3/client.hpp"
#include "test_util.hpp"

namespace ferry::testing {

struct S3Server {
  std::string unavailable;  // why not, empty when it runs
  s3::Config config;
};

inline S3Server s3_server() {
  S3Server s;
  const char* path = std::getenv("FERRY_S3_ENV");
  if (!path || !*path) {
    s.unavailable = "FERRY_S3_ENV is not set (ctest starts the server: tests/s3/s3server.sh)";
    return s;
  }
  std::ifstream in(path);
  if (!in) {
    s.unavailable = std::string("no S3 server: ") + path + " is missing";
    return s;
  }
  std::map<std::string, std::string> env;
  for (std::string line; std::getline(in, line);) {
    auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  if (env.count("FERRY_S3_UNAVAILABLE")) {
    s.unavailable = "no S3 server: " + env["FERRY_S3_UNAVAILABLE"];
    return s;
  }
  s.config.endpoint = env["FERRY_S3_ENDPOINT"];
  s.config.access_key = env["AWS_ACCESS_KEY_ID"];
  s.config.secret_key = env["AWS_SECRET_ACCESS_KEY"];
  s.config.region = env["AWS_REGION"];
  return s;
}

inline bool s3_required() {
  const char* v = std::getenv("FERRY_REQUIRE_S3");
  return v && std::string(v) == "1";
}

// A bucket of its own for each test case: "ferry-<pid>-<n>".
inline std::string fresh_bucket() {
  static std::atomic<int> n{0};
  return "ferry-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

inline const Status& status_of(const Status& s) {
  return s;
}
template <class T>
Status status_of(const Result<T>& r) {
  return r.ok() ? Status() : r.status();
}

}  // namespace ferry::testing

// REQUIRE(ok) that prints the error when it is not.
#define REQUIRE_OK(expr)                                               \
  do {                                                                 \
    const ::ferry::Status status_ = ::ferry::testing::status_of(expr); \
    INFO(status_.to_string());                                         \
    REQUIRE(status_.ok());                                             \
  } while (false)

// Declares `server` (an S3Server) or ends the test case: skipped, or failed
// under FERRY_REQUIRE_S3=1.
#define FERRY_S3_SERVER(server)                                                                 \
  ::ferry::testing::S3Server server = ::ferry::testing::s3_server();                            \
  if (!server.unavailable.empty()) {                                                            \
    if (::ferry::testing::s3_required()) FAIL("FERRY_REQUIRE_S3=1 but " << server.unavailable); \
    FERRY_SKIP(server.unavailable << " (FERRY_REQUIRE_S3=1 makes this a failure)");             \
  }
