#include "s3/client.hpp"

#include <curl/curl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "s3/xml.hpp"

namespace ferry::s3 {
namespace {

constexpr size_t kMaxXmlBytes = 64u << 20;
constexpr size_t kMaxErrorBodyBytes = 64u << 10;

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

bool valid_bucket_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.';
}

// RFC 3986 unreserved characters pass; '/' passes in paths only.
std::string uri_encode(const std::string& s, bool keep_slash) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
        c == '.' || c == '_' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

std::string base64_md5(const std::string& body) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(body.data(), body.size(), digest, &n, EVP_md5(), nullptr);
  unsigned char b64[4 * ((EVP_MAX_MD_SIZE + 2) / 3) + 1];
  int len = EVP_EncodeBlock(b64, digest, static_cast<int>(n));
  return std::string(reinterpret_cast<char*>(b64), static_cast<size_t>(len));
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

}  // namespace

void config_from_environment(Config* c) {
  if (c->access_key.empty()) c->access_key = env_or_empty("AWS_ACCESS_KEY_ID");
  if (c->secret_key.empty()) c->secret_key = env_or_empty("AWS_SECRET_ACCESS_KEY");
  if (c->session_token.empty()) c->session_token = env_or_empty("AWS_SESSION_TOKEN");
  std::string region = env_or_empty("AWS_REGION");
  if (region.empty()) region = env_or_empty("AWS_DEFAULT_REGION");
  if (!region.empty() && c->region == Config().region) c->region = region;
}

void release_thread_state() {
  OPENSSL_thread_stop();
}

bool is_s3_url(const std::string& root) {
  return root.rfind("s3://", 0) == 0;
}

Result<Url> parse_url(const std::string& url) {
  if (!is_s3_url(url))
    return Status::invalid_argument("'" + url + "' is not an s3:// URL (s3://bucket/prefix)");
  std::string rest = url.substr(5);
  auto slash = rest.find('/');
  Url u;
  u.bucket = rest.substr(0, slash);
  if (u.bucket.size() < 3 || u.bucket.size() > 63 ||
      !std::all_of(u.bucket.begin(), u.bucket.end(), valid_bucket_char) ||
      u.bucket.front() == '-' || u.bucket.front() == '.' || u.bucket.back() == '-' ||
      u.bucket.back() == '.')
    return Status::invalid_argument("'" + url + "': bucket name '" + u.bucket +
                                    "' is not valid (3-63 characters of a-z, 0-9, '-', '.')");
  if (slash == std::string::npos) return u;
  std::string prefix = rest.substr(slash + 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  size_t start = 0;
  while (start < prefix.size()) {
    size_t end = prefix.find('/', start);
    if (end == std::string::npos) end = prefix.size();
    std::string part = prefix.substr(start, end - start);
    if (part.empty() || part == "." || part == "..")
      return Status::invalid_argument("'" + url + "': the prefix has an empty, '.' or '..' part");
    for (unsigned char c : part)
      if (c < 0x20 || c == 0x7f)
        return Status::invalid_argument("'" + url + "': the prefix has a control character");
    start = end + 1;
  }
  u.prefix = prefix;
  return u;
}

int64_t Deadline::left_ms() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now()).count();
}

// One HTTP exchange: what to send, where the answer goes, and what came back.
struct Client::Request {
  std::string op;  // S3's name for it, for errors: "PutObject"
  std::string method;
  std::string bucket;
  std::string key;
  std::string query;  // already encoded, parameters sorted by name (SigV4)
  std::vector<std::string> headers;
  const char* body = nullptr;
  size_t body_len = 0;
  // A GET into the caller's buffer; otherwise the body lands in `response`.
  char* out = nullptr;
  size_t out_cap = 0;
  size_t response_cap = kMaxXmlBytes;

  // Filled by each attempt.
  size_t sent = 0;
  size_t out_len = 0;
  bool overflow = false;
  std::string response;
  std::string etag;
  std::string content_length;
  long http = 0;
  bool head_complete = false;  // the blank line after the headers came
  int attempts = 0;

  std::string object() const { return "s3://" + bucket + (key.empty() ? "" : "/" + key); }
  void reset_attempt() {
    sent = 0;
    out_len = 0;
    overflow = false;
    response.clear();
    etag.clear();
    content_length.clear();
    http = 0;
    head_complete = false;
  }
};

// Easy handles kept with their connections open; callers beyond `connections`
// wait for one to come back.
struct Client::Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<CURL*> idle;
  int created = 0;
  int limit = 8;

  CURL* acquire() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return !idle.empty() || created < limit; });
    if (!idle.empty()) {
      CURL* h = idle.back();
      idle.pop_back();
      return h;
    }
    ++created;
    lock.unlock();
    return curl_easy_init();
  }
  void release(CURL* h) {
    {
      std::lock_guard<std::mutex> lock(mu);
      idle.push_back(h);
    }
    cv.notify_one();
  }
  ~Pool() {
    for (CURL* h : idle) curl_easy_cleanup(h);
  }
};

namespace {

size_t on_read(char* buf, size_t size, size_t n, void* data) {
  auto* r = static_cast<Client::Request*>(data);
  size_t want = std::min(size * n, r->body_len - r->sent);
  if (want == 0) return 0;
  std::memcpy(buf, r->body + r->sent, want);
  r->sent += want;
  return want;
}

size_t on_write(char* buf, size_t size, size_t n, void* data) {
  auto* r = static_cast<Client::Request*>(data);
  size_t len = size * n;
  bool ok_status = r->http == 0 || (r->http >= 200 && r->http < 300);
  if (r->out && ok_status) {
    if (len > r->out_cap - r->out_len) {
      r->overflow = true;
      return 0;  // aborts the transfer: never write past the caller's buffer
    }
    std::memcpy(r->out + r->out_len, buf, len);
    r->out_len += len;
    return len;
  }
  size_t cap = ok_status ? r->response_cap : kMaxErrorBodyBytes;
  if (len > cap - std::min(cap, r->response.size())) {
    r->overflow = true;
    return 0;
  }
  r->response.append(buf, len);
  return len;
}

// Header lines: the status line resets what an earlier response (a 100
// Continue, a redirect) left; ETag and Content-Length are kept.
size_t on_header(char* buf, size_t size, size_t n, void* data) {
  auto* r = static_cast<Client::Request*>(data);
  size_t len = size * n;
  std::string line(buf, len);
  while (!line.empty() && (line.back() == '\r' || line.back() == '\n')) line.pop_back();
  if (line.rfind("HTTP/", 0) == 0) {
    auto sp = line.find(' ');
    r->http = sp == std::string::npos ? 0 : std::atol(line.c_str() + sp + 1);
    r->head_complete = false;
    return len;
  }
  if (line.empty()) {
    r->head_complete = r->http != 0;
    return len;
  }
  auto colon = line.find(':');
  if (colon == std::string::npos) return len;
  std::string name = line.substr(0, colon);
  std::transform(name.begin(), name.end(), name.begin(), ::tolower);
  std::string value = line.substr(colon + 1);
  value.erase(0, value.find_first_not_of(' '));
  if (name == "etag") r->etag = value;
  if (name == "content-length") r->content_length = value;
  return len;
}

bool retryable_curl(CURLcode c) {
  switch (c) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_WEIRD_SERVER_REPLY:  // an answer torn inside its headers
    case CURLE_PARTIAL_FILE:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

struct S3Error {
  std::string code;
  std::string message;
};

S3Error s3_error(const std::string& body) {
  if (body.empty()) return {};
  auto doc = parse_xml(body, "error");
  if (!doc.ok()) return {};
  return {doc.value().child_text("Code"), doc.value().child_text("Message")};
}

}  // namespace

Client::Client(Config config) : config_(std::move(config)), pool_(std::make_unique<Pool>()) {
  pool_->limit = std::max(1, config_.connections);
}

Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::create(const Config& config) {
  if (config.access_key.empty() != config.secret_key.empty())
    return Status::invalid_argument(
        "S3 credentials: an access key without a secret key or the reverse "
        "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)");
  if (!config.endpoint.empty() && config.endpoint.rfind("http://", 0) != 0 &&
      config.endpoint.rfind("https://", 0) != 0)
    return Status::invalid_argument("s3-endpoint '" + config.endpoint +
                                    "' must start with http:// or https://");
  if (config.region.empty()) return Status::invalid_argument("s3-region is empty");
  global_init();
  return std::unique_ptr<Client>(new Client(config));
}

Status Client::perform(Request& r, Deadline d) {
  std::string endpoint = config_.endpoint.empty()
                             ? "https://s3." + config_.region + ".amazonaws.com"
                             : config_.endpoint;
  while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
  std::string url;
  if (config_.virtual_addressing && !r.bucket.empty()) {
    auto scheme_end = endpoint.find("://") + 3;
    url = endpoint.substr(0, scheme_end) + r.bucket + "." + endpoint.substr(scheme_end) + "/" +
          uri_encode(r.key, true);
  } else {
    url = endpoint + "/" + r.bucket + (r.key.empty() ? "" : "/" + uri_encode(r.key, true));
  }
  if (!r.query.empty()) url += "?" + r.query;
  std::string sigv4 = "aws:amz:" + config_.region + ":s3";

  std::mt19937_64 rng(std::random_device{}());
  Status last;
  for (int attempt = 1;; ++attempt) {
    int64_t left = d.left_ms();
    if (left <= 0) {
      std::string why = last.ok() ? "" : " (last attempt: " + last.message() + ")";
      return Status::timeout(r.op + " " + r.object() + ": deadline passed after " +
                             std::to_string(attempt - 1) + " attempt(s)" + why);
    }
    r.reset_attempt();
    r.attempts = attempt;
    std::string target;
    if (config_.hook) {
      target =
          config_.hook->before({r.op, r.key, attempt, std::min(left, config_.attempt_timeout_ms)});
      left = std::max<int64_t>(1, d.left_ms());
    }
    CURL* h = pool_->acquire();
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, target.empty() ? url.c_str() : target.c_str());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS,
                     static_cast<long>(std::min(left, config_.attempt_timeout_ms)));
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(std::min(left, config_.connect_timeout_ms)));
    if (!config_.access_key.empty()) {
      curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
      curl_easy_setopt(h, CURLOPT_USERNAME, config_.access_key.c_str());
      curl_easy_setopt(h, CURLOPT_PASSWORD, config_.secret_key.c_str());
    }
    curl_slist* headers = nullptr;
    // The payload is checked by Ferry's own checksums, not by the signature.
    headers = curl_slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!config_.session_token.empty())
      headers =
          curl_slist_append(headers, ("x-amz-security-token: " + config_.session_token).c_str());
    for (const auto& line : r.headers) headers = curl_slist_append(headers, line.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    if (r.method == "PUT") {
      // curl asks for a 100 Continue before the body (a blank Expect header
      // to stop it would be signed but not sent); a server that never sends
      // one costs this, not curl's default second.
      curl_easy_setopt(h, CURLOPT_EXPECT_100_TIMEOUT_MS, 50L);
      curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(h, CURLOPT_READFUNCTION, on_read);
      curl_easy_setopt(h, CURLOPT_READDATA, &r);
      curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body_len));
    } else if (r.method == "POST") {
      curl_easy_setopt(h, CURLOPT_POST, 1L);
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, r.body ? r.body : "");
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(r.body_len));
    } else if (r.method == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (r.method != "GET") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, r.method.c_str());
    }
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r);
    char curl_error[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, curl_error);
    CURLcode rc = curl_easy_perform(h);
    curl_slist_free_all(headers);
    if (rc != CURLE_OK) {
      // A connection in an unknown state is not reused.
      curl_easy_cleanup(h);
      h = curl_easy_init();
    }
    pool_->release(h);

    bool retry = false;
    if (r.overflow) {
      return Status::corruption(
          r.op + " " + r.object() + ": the server sent more bytes than " +
          (r.out ? std::to_string(r.out_cap) + " asked for" : std::string("the response limit")));
    } else if (rc != CURLE_OK) {
      last = Status::io_error(r.op + " " + r.object() + ": " +
                              (curl_error[0] ? curl_error : curl_easy_strerror(rc)));
      retry = retryable_curl(rc);
    } else if (!r.head_complete) {
      // curl takes a connection closed inside the headers (no body to
      // expect, as for HEAD) for an answer: it is a torn one.
      last = Status::io_error(r.op + " " + r.object() + ": the answer (HTTP " +
                              std::to_string(r.http) + ") ended inside its headers");
      retry = true;
    } else if (r.http >= 200 && r.http < 300) {
      return Status();
    } else {
      S3Error e = s3_error(r.response);
      std::string what = r.op + " " + r.object() + ": HTTP " + std::to_string(r.http) +
                         (e.code.empty() ? "" : " " + e.code) +
                         (e.message.empty() ? "" : " (" + e.message + ")");
      if (r.http == 404) return Status::not_found(what);
      if (r.http == 412) return Status::already_exists(what);
      if (r.http == 400 || r.http == 401 || r.http == 403 || r.http == 405 || r.http == 409 ||
          r.http == 411 || r.http == 416)
        return Status::io_error(what);
      last = Status::io_error(what);
      retry = r.http >= 500 || r.http == 429 || e.code == "SlowDown" ||
              e.code == "RequestTimeout" || e.code == "InternalError";
    }
    if (!retry || attempt >= config_.max_attempts)
      return attempt > 1 ? last.with_context("after " + std::to_string(attempt) + " attempts: ")
                         : last;
    // Full jitter: 50 ms doubling, capped at 2 s, never past the deadline.
    int64_t cap = std::min<int64_t>(2000, 50ll << std::min(attempt - 1, 6));
    int64_t sleep_ms = std::uniform_int_distribution<int64_t>(cap / 4, cap)(rng);
    sleep_ms = std::min(sleep_ms, std::max<int64_t>(0, d.left_ms()));
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  }
}

Status Client::create_bucket(const std::string& bucket, Deadline d) {
  Request r;
  r.op = "CreateBucket";
  r.method = "PUT";
  r.bucket = bucket;
  Status s = perform(r, d);
  // Ours already (BucketAlreadyOwnedByYou) is success.
  if (!s.ok() && s.message().find("BucketAlreadyOwnedByYou") != std::string::npos) return Status();
  return s;
}

Status Client::put(const std::string& bucket, const std::string& key, const void* data, size_t len,
                   const PutOptions& o, Deadline d) {
  Request r;
  r.op = "PutObject";
  r.method = "PUT";
  r.bucket = bucket;
  r.key = key;
  r.body = static_cast<const char*>(data);
  r.body_len = len;
  r.headers.push_back("Content-Type: " + o.content_type);
  if (o.if_absent) r.headers.push_back("If-None-Match: *");
  Status s = perform(r, d);
  if (s.code() == StatusCode::already_exists && o.if_absent && r.attempts > 1) {
    // A retried create-once PUT whose first try landed: ours if the bytes are.
    auto now = get_all(bucket, key, len, d);
    if (now.ok() && now.value().size() == len && std::memcmp(now.value().data(), data, len) == 0)
      return Status();
  }
  return s;
}

Result<size_t> Client::get(const std::string& bucket, const std::string& key, uint64_t offset,
                           void* out, size_t len, Deadline d) {
  if (len == 0) return size_t{0};
  Request r;
  r.op = "GetObject";
  r.method = "GET";
  r.bucket = bucket;
  r.key = key;
  r.out = static_cast<char*>(out);
  r.out_cap = len;
  r.headers.push_back("Range: bytes=" + std::to_string(offset) + "-" +
                      std::to_string(offset + len - 1));
  Status s = perform(r, d);
  // A range starting at or past the end: nothing there, as pread says.
  if (!s.ok() && r.http == 416) return size_t{0};
  if (!s.ok()) return s;
  if (r.http == 200 && offset != 0)
    return Status::corruption("GetObject " + r.object() + ": the server ignored the range " +
                              std::to_string(offset) + "+" + std::to_string(len));
  return r.out_len;
}

Result<std::string> Client::get_all(const std::string& bucket, const std::string& key,
                                    uint64_t max_bytes, Deadline d) {
  auto info = head(bucket, key, d);
  if (!info.ok()) return info.status();
  if (info.value().size > max_bytes)
    return Status::corruption("GetObject s3://" + bucket + "/" + key + ": " +
                              std::to_string(info.value().size) + " bytes, over the limit of " +
                              std::to_string(max_bytes));
  std::string out(info.value().size, '\0');
  // One byte more than HEAD said, so an object grown in between is seen.
  out.resize(out.size() + 1);
  auto got = get(bucket, key, 0, out.data(), out.size(), d);
  if (!got.ok()) return got.status();
  if (got.value() > max_bytes)
    return Status::corruption("GetObject s3://" + bucket + "/" + key + ": grew over the limit of " +
                              std::to_string(max_bytes) + " bytes while read");
  out.resize(got.value());
  return out;
}

Result<ObjectInfo> Client::head(const std::string& bucket, const std::string& key, Deadline d) {
  Request r;
  r.op = "HeadObject";
  r.method = "HEAD";
  r.bucket = bucket;
  r.key = key;
  Status s = perform(r, d);
  if (!s.ok()) return s;
  ObjectInfo info;
  info.key = key;
  info.size = std::strtoull(r.content_length.c_str(), nullptr, 10);
  info.etag = r.etag;
  return info;
}

Result<std::vector<ObjectInfo>> Client::list(const std::string& bucket, const std::string& prefix,
                                             Deadline d, const std::string& delimiter) {
  std::vector<ObjectInfo> out;
  std::string token;
  for (;;) {
    Request r;
    r.op = "ListObjectsV2";
    r.method = "GET";
    r.bucket = bucket;
    r.query = (token.empty() ? "" : "continuation-token=" + uri_encode(token, false) + "&") +
              (delimiter.empty() ? "" : "delimiter=" + uri_encode(delimiter, false) + "&") +
              "list-type=2&prefix=" + uri_encode(prefix, false);
    Status s = perform(r, d);
    if (!s.ok()) return s;
    auto doc = parse_xml(r.response, "ListObjectsV2 of " + r.object());
    if (!doc.ok()) return doc.status();
    for (const auto& c : doc.value().children) {
      if (c.name == "CommonPrefixes") out.push_back({c.child_text("Prefix"), 0, ""});
      if (c.name != "Contents") continue;
      ObjectInfo info;
      info.key = c.child_text("Key");
      info.size = std::strtoull(c.child_text("Size").c_str(), nullptr, 10);
      info.etag = c.child_text("ETag");
      out.push_back(std::move(info));
    }
    if (doc.value().child_text("IsTruncated") != "true") break;
    std::string next = doc.value().child_text("NextContinuationToken");
    if (next.empty() || next == token)
      return Status::corruption("ListObjectsV2 of " + r.object() +
                                ": truncated without a new continuation token");
    token = next;
  }
  return out;
}

Status Client::remove(const std::string& bucket, const std::vector<std::string>& keys, Deadline d) {
  for (size_t start = 0; start < keys.size(); start += 1000) {
    std::string body = "<Delete><Quiet>true</Quiet>";
    size_t end = std::min(keys.size(), start + 1000);
    for (size_t i = start; i < end; ++i)
      body += "<Object><Key>" + xml_escape(keys[i]) + "</Key></Object>";
    body += "</Delete>";
    Request r;
    r.op = "DeleteObjects";
    r.method = "POST";
    r.bucket = bucket;
    r.query = "delete=";
    r.body = body.data();
    r.body_len = body.size();
    r.headers.push_back("Content-Type: application/xml");
    r.headers.push_back("Content-MD5: " + base64_md5(body));
    Status s = perform(r, d);
    if (!s.ok()) return s;
    // Quiet mode lists only the failures.
    auto doc = parse_xml(r.response, "DeleteObjects of " + r.object());
    if (!doc.ok()) return doc.status();
    for (const auto& c : doc.value().children) {
      if (c.name != "Error") continue;
      return Status::io_error("DeleteObjects s3://" + bucket + "/" + c.child_text("Key") + ": " +
                              c.child_text("Code") + " (" + c.child_text("Message") + ")");
    }
  }
  return Status();
}

Result<std::string> Client::create_multipart(const std::string& bucket, const std::string& key,
                                             Deadline d) {
  Request r;
  r.op = "CreateMultipartUpload";
  r.method = "POST";
  r.bucket = bucket;
  r.key = key;
  r.query = "uploads=";
  r.headers.push_back("Content-Type: application/octet-stream");
  Status s = perform(r, d);
  if (!s.ok()) return s;
  auto doc = parse_xml(r.response, "CreateMultipartUpload of " + r.object());
  if (!doc.ok()) return doc.status();
  std::string id = doc.value().child_text("UploadId");
  if (id.empty())
    return Status::corruption("CreateMultipartUpload " + r.object() +
                              ": no UploadId in the answer");
  return id;
}

Result<std::string> Client::upload_part(const std::string& bucket, const std::string& key,
                                        const std::string& upload_id, int part_number,
                                        const void* data, size_t len, Deadline d) {
  Request r;
  r.op = "UploadPart";
  r.method = "PUT";
  r.bucket = bucket;
  r.key = key;
  r.query =
      "partNumber=" + std::to_string(part_number) + "&uploadId=" + uri_encode(upload_id, false);
  r.body = static_cast<const char*>(data);
  r.body_len = len;
  Status s = perform(r, d);
  if (!s.ok()) return s.with_context("part " + std::to_string(part_number) + ": ");
  if (r.etag.empty())
    return Status::corruption("UploadPart " + r.object() + " part " + std::to_string(part_number) +
                              ": no ETag in the answer");
  return r.etag;
}

Status Client::complete_multipart(const std::string& bucket, const std::string& key,
                                  const std::string& upload_id,
                                  const std::vector<std::string>& etags, Deadline d) {
  std::string body = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < etags.size(); ++i)
    body += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" +
            xml_escape(etags[i]) + "</ETag></Part>";
  body += "</CompleteMultipartUpload>";
  Request r;
  r.op = "CompleteMultipartUpload";
  r.method = "POST";
  r.bucket = bucket;
  r.key = key;
  r.query = "uploadId=" + uri_encode(upload_id, false);
  r.body = body.data();
  r.body_len = body.size();
  r.headers.push_back("Content-Type: application/xml");
  Status s = perform(r, d);
  if (!s.ok()) return s;
  // S3 may answer 200 and put the failure in the body.
  if (!r.response.empty()) {
    auto doc = parse_xml(r.response, "CompleteMultipartUpload of " + r.object());
    if (!doc.ok()) return doc.status();
    if (doc.value().name == "Error")
      return Status::io_error("CompleteMultipartUpload " + r.object() + ": " +
                              doc.value().child_text("Code") + " (" +
                              doc.value().child_text("Message") + ")");
  }
  return Status();
}

Status Client::abort_multipart(const std::string& bucket, const std::string& key,
                               const std::string& upload_id, Deadline d) {
  Request r;
  r.op = "AbortMultipartUpload";
  r.method = "DELETE";
  r.bucket = bucket;
  r.key = key;
  r.query = "uploadId=" + uri_encode(upload_id, false);
  Status s = perform(r, d);
  return s.code() == StatusCode::not_found ? Status() : s;
}

Result<std::vector<Upload>> Client::list_multipart(const std::string& bucket,
                                                   const std::string& prefix, Deadline d) {
  std::vector<Upload> out;
  std::string key_marker, id_marker;
  for (;;) {
    Request r;
    r.op = "ListMultipartUploads";
    r.method = "GET";
    r.bucket = bucket;
    r.query = (key_marker.empty() ? "" : "key-marker=" + uri_encode(key_marker, false) + "&") +
              "prefix=" + uri_encode(prefix, false) +
              (id_marker.empty() ? "" : "&upload-id-marker=" + uri_encode(id_marker, false)) +
              "&uploads=";
    Status s = perform(r, d);
    if (!s.ok()) return s;
    auto doc = parse_xml(r.response, "ListMultipartUploads of " + r.object());
    if (!doc.ok()) return doc.status();
    for (const auto& c : doc.value().children) {
      if (c.name != "Upload") continue;
      out.push_back({c.child_text("Key"), c.child_text("UploadId"), c.child_text("Initiated")});
    }
    if (doc.value().child_text("IsTruncated") != "true") break;
    std::string nk = doc.value().child_text("NextKeyMarker");
    std::string ni = doc.value().child_text("NextUploadIdMarker");
    if (nk == key_marker && ni == id_marker)
      return Status::corruption("ListMultipartUploads of " + r.object() +
                                ": truncated without new markers");
    key_marker = nk;
    id_marker = ni;
  }
  return out;
}

}  // namespace ferry::s3
