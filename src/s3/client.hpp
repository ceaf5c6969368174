// An S3 client over libcurl: the object operations a checkpoint store needs
// (single PUT, create-once PUT, ranged GET, HEAD, list, batch delete,
// multipart upload), each bounded by a deadline and retried with jittered
// backoff on what S3 asks to retry (5xx, SlowDown, reset connections).
// Errors name the operation, the object and the HTTP status with S3's own
// error code. Requests are signed with AWS SigV4 by libcurl.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/status.hpp"

namespace ferry::s3 {

// One attempt of a request, as a fault injector sees it.
struct AttemptInfo {
  const std::string& op;   // S3's name for the request: "UploadPart"
  const std::string& key;  // the object's key in the bucket, "" for bucket-wide requests
  int attempt;             // 1 for the first try
  int64_t bound_ms;        // the attempt's own time bound
};

// Sees each attempt before it is sent and may send it elsewhere: the drills'
// fault peer, which answers as a failing server would (FERRY_FAULTS http:
// rules, src/drills/http_faults.hpp). Production requests have none.
class AttemptHook {
 public:
  virtual ~AttemptHook() = default;
  // The URL to send this attempt to instead, or "" for the server. May
  // sleep (injected latency) within `bound_ms`.
  virtual std::string before(const AttemptInfo& a) = 0;
};

// Where and as whom to talk. Credentials are never part of an error text.
struct Config {
  std::string endpoint;  // "http://127.0.0.1:7480"; empty: https://s3.REGION.amazonaws.com
  std::string region = "us-east-1";
  bool virtual_addressing = false;  // bucket.host/key instead of host/bucket/key
  std::string access_key;
  std::string secret_key;
  std::string session_token;
  // Each attempt's own bound, inside the call's deadline.
  int64_t attempt_timeout_ms = 30'000;
  int64_t connect_timeout_ms = 5'000;
  // Connections kept alive for reuse; more callers than this wait for one.
  int connections = 8;
  int max_attempts = 6;
  std::shared_ptr<AttemptHook> hook;  // none outside fault drills
};

// Fills credentials and region from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
// AWS_SESSION_TOKEN, AWS_REGION / AWS_DEFAULT_REGION where `c` has none.
void config_from_environment(Config* c);

// "s3://bucket/some/prefix" -> bucket "bucket", prefix "some/prefix" (no
// slashes at either end). Refuses other schemes, an empty or invalid bucket
// name and ".." or empty components in the prefix, naming the URL.
struct Url {
  std::string bucket;
  std::string prefix;
};
Result<Url> parse_url(const std::string& url);
bool is_s3_url(const std::string& root);

// Frees what the HTTP stack keeps per thread (OpenSSL's error queue, which
// SigV4's hashing creates). A thread frees it on exit by itself, except one
// that ends while the process exits: OpenSSL's exit handler has by then
// removed the key whose destructor would free it. CAF's detached actor
// threads are such threads (they report their end before they exit), so the
// runtime calls this as each CAF thread ends.
void release_thread_state();

using Clock = std::chrono::steady_clock;
// The whole call, retries included, ends by this time.
struct Deadline {
  Clock::time_point at;
  static Deadline in(std::chrono::milliseconds d) { return {Clock::now() + d}; }
  int64_t left_ms() const;
};

struct ObjectInfo {
  std::string key;
  uint64_t size = 0;
  std::string etag;
};

struct Upload {
  std::string key;
  std::string upload_id;
  std::string initiated;  // ISO 8601, as the server sent it
};

struct PutOptions {
  // Create-once: fails with already_exists if the key exists (If-None-Match: *).
  bool if_absent = false;
  std::string content_type = "application/octet-stream";
};

class Client {
 public:
  static Result<std::unique_ptr<Client>> create(const Config& config);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const Config& config() const { return config_; }

  Status create_bucket(const std::string& bucket, Deadline d);
  Status put(const std::string& bucket, const std::string& key, const void* data, size_t len,
             const PutOptions& o, Deadline d);
  // Reads [offset, offset + len) into `out`; returns the bytes read, fewer
  // only at the object's end. A server sending more than asked is an error.
  Result<size_t> get(const std::string& bucket, const std::string& key, uint64_t offset, void* out,
                     size_t len, Deadline d);
  // The whole object, refused (naming its size) above `max_bytes`.
  Result<std::string> get_all(const std::string& bucket, const std::string& key, uint64_t max_bytes,
                              Deadline d);
  Result<ObjectInfo> head(const std::string& bucket, const std::string& key, Deadline d);
  // Every object under `prefix`, in key order, following continuations.
  // With a `delimiter`, keys holding it past the prefix come once each as
  // their common prefix (up to and with the delimiter, size 0).
  Result<std::vector<ObjectInfo>> list(const std::string& bucket, const std::string& prefix,
                                       Deadline d, const std::string& delimiter = "");
  // Deletes the keys (absent ones are not an error), 1,000 per request.
  Status remove(const std::string& bucket, const std::vector<std::string>& keys, Deadline d);

  Result<std::string> create_multipart(const std::string& bucket, const std::string& key,
                                       Deadline d);
  // Part numbers start at 1; returns the part's ETag for complete_multipart.
  Result<std::string> upload_part(const std::string& bucket, const std::string& key,
                                  const std::string& upload_id, int part_number, const void* data,
                                  size_t len, Deadline d);
  Status complete_multipart(const std::string& bucket, const std::string& key,
                            const std::string& upload_id, const std::vector<std::string>& etags,
                            Deadline d);
  Status abort_multipart(const std::string& bucket, const std::string& key,
                         const std::string& upload_id, Deadline d);
  Result<std::vector<Upload>> list_multipart(const std::string& bucket, const std::string& prefix,
                                             Deadline d);

  struct Request;
  struct Pool;

 private:
  explicit Client(Config config);
  Status perform(Request& r, Deadline d);

  Config config_;
  std::unique_ptr<Pool> pool_;
};

}  // namespace ferry::s3
