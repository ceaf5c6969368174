// HTTP faults under the S3 store: FERRY_FAULTS `http:` rules pick requests
// by operation and key and make their attempts fail as a sick server or
// network would (an error status with S3's error code, a reset connection,
// a truncated body, a response that never comes, added latency). The S3
// client asks an AttemptHook before each attempt (src/s3/client.hpp); this
// one sends the chosen attempts to a fault peer on 127.0.0.1 that answers
// them so, so the client's own retries, backoff and deadlines are what a
// drill exercises. Part of the drills library (see fault_fs.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/status.hpp"
#include "s3/client.hpp"

namespace ferry {

struct HttpFaultRule {
  enum class Action : uint8_t {
    status,    // answer `status` with S3 error `code`
    reset,     // reset the connection once the request is read
    truncate,  // answer 200 and close halfway through the body
    stall,     // read the request and never answer (until the client gives up)
    latency,   // delay every matching attempt by `latency` (within its bound)
  };
  Action action = Action::status;
  int status = 503;
  std::string code = "SlowDown";
  // put, get, head, list, part, create, complete, abort, delete, uploads,
  // bucket, or any (see http_fault_op).
  std::string op = "any";
  // Which matching attempts (counted per rule, from 1): the nth, the nth
  // and every later one (sticky), the nth to the last (last > nth), or,
  // when nth is 0, each with probability rate_num/rate_den (seeded).
  uint64_t nth = 0;
  uint64_t last = 0;
  bool sticky = false;
  uint64_t rate_num = 0;
  uint64_t rate_den = 0;
  uint64_t seed = 1;
  // Only keys containing this ('$' at its end anchors it), empty: all.
  std::string key_contains;
  std::chrono::microseconds latency{0};

  std::string to_string() const;  // the spec form, e.g. "http:503:part:1-2"
};

// The rule operation of an S3 request ("UploadPart" -> "part").
std::string http_fault_op(const std::string& s3_op);

// One `http:` item of a FERRY_FAULTS spec:
//   http:ACTION:OP[:TRIGGER](:OPTION)*
//   ACTION  := 3-digit status | reset | truncate | stall | latency
//   TRIGGER := N | N+ | N-M | rate=A/B    (latency: a DURATION, 5ms)
//   OPTION  := key=SUBSTR | code=S3CODE | seed=N
// A status's code defaults to SlowDown for 503 and 429, InternalError for
// 500, else Injected. invalid_argument names the part that is wrong.
Result<HttpFaultRule> parse_http_fault(const std::string& item);

class HttpFaults : public s3::AttemptHook {
 public:
  explicit HttpFaults(std::vector<HttpFaultRule> rules);
  std::string before(const s3::AttemptInfo& a) override;

  // Attempts seen of a rule operation ("part"), faulted or not; faults
  // injected (latency not counted); attempts delayed.
  uint64_t attempts(const std::string& op) const;
  uint64_t injected() const;
  uint64_t delayed() const;

 private:
  struct RuleState {
    HttpFaultRule rule;
    uint64_t seen = 0;
    uint64_t rng = 0;
  };
  mutable std::mutex mu_;
  std::vector<RuleState> rules_;
  std::vector<std::pair<std::string, uint64_t>> attempts_;
  uint64_t injected_ = 0;
  uint64_t delayed_ = 0;
};

// The injector of `rules` (null when there are none).
Result<std::shared_ptr<HttpFaults>> http_faults_from_rules(std::vector<HttpFaultRule> rules);

// The injector of the http: rules in FERRY_FAULTS (`var`), null when it has
// none. One per process and spec: every runtime and store of the process
// shares it (and its counts), so a test reads what its runtime did.
Result<std::shared_ptr<HttpFaults>> http_faults_from_env(const char* var = "FERRY_FAULTS");

}  // namespace ferry
