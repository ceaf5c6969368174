// The S3 client against the real server (radosgw) and, for what a healthy
// server never does (503s, stalls), against a scripted HTTP peer on loopback.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "s3/client.hpp"
#include "s3_server.hpp"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<s3::Client> client_for(const s3::Config& c) {
  auto made = s3::Client::create(c);
  REQUIRE(made.ok());
  return std::move(made).value();
}

std::string bytes_of(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (auto& ch : s) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    ch = static_cast<char>(x);
  }
  return s;
}

// An HTTP peer on 127.0.0.1 that answers each request with the next of
// `answers` (the last one repeats); "stall" accepts and never answers.
class ScriptedPeer {
 public:
  explicit ScriptedPeer(std::vector<std::string> answers) : answers_(std::move(answers)) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    REQUIRE(listen(fd_, 16) == 0);
    thread_ = std::thread([this] { serve(); });
  }
  ~ScriptedPeer() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
    for (int c : held_) close(c);
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int requests() const { return requests_; }

 private:
  void serve() {
    while (!stop_) {
      int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      // One request per connection: each answer closes it.
      for (;;) {
        std::string req;
        char buf[4096];
        while (req.find("\r\n\r\n") == std::string::npos) {
          ssize_t n = read(c, buf, sizeof buf);
          if (n <= 0) break;
          req.append(buf, static_cast<size_t>(n));
        }
        if (req.find("\r\n\r\n") == std::string::npos) break;
        size_t body = 0;
        auto cl = req.find("Content-Length: ");
        if (cl != std::string::npos) body = std::strtoull(req.c_str() + cl + 16, nullptr, 10);
        size_t have = req.size() - (req.find("\r\n\r\n") + 4);
        while (have < body) {
          ssize_t n = read(c, buf, std::min(sizeof buf, body - have));
          if (n <= 0) break;
          have += static_cast<size_t>(n);
        }
        int i = requests_++;
        const std::string& a = answers_[std::min<size_t>(i, answers_.size() - 1)];
        if (a == "stall") {
          held_.push_back(c);
          c = -1;
          break;
        }
        (void)!write(c, a.data(), a.size());
        break;
      }
      if (c >= 0) close(c);
    }
  }

  std::vector<std::string> answers_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::vector<int> held_;
  std::thread thread_;
};

std::string http(int code, const std::string& reason, const std::string& body,
                 const std::string& extra = "") {
  return "HTTP/1.1 " + std::to_string(code) + " " + reason +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n" +
         extra + "\r\n" + body;
}

std::string s3_error_body(const std::string& code) {
  return "<?xml version=\"1.0\"?><Error><Code>" + code +
         "</Code><Message>try again</Message></Error>";
}

}  // namespace

TEST_CASE("URLs name a bucket and a clean prefix, and bad ones are refused by name", "[s3][url]") {
  auto u = s3::parse_url("s3://my-bucket/run1/sub/");
  REQUIRE(u.ok());
  CHECK(u.value().bucket == "my-bucket");
  CHECK(u.value().prefix == "run1/sub");
  auto bare = s3::parse_url("s3://bucket");
  REQUIRE(bare.ok());
  CHECK(bare.value().prefix.empty());
  for (const char* bad : {"s3://", "s3://Bucket/x", "s3://ab/x", "s3://b_c/x", "s3://bucket/a//b",
                          "s3://bucket/a/../b", "/local/dir", "s3://-bucket/x"}) {
    auto r = s3::parse_url(bad);
    INFO(bad);
    CHECK_FALSE(r.ok());
    CHECK(r.status().message().find(bad) != std::string::npos);
  }
}

TEST_CASE("objects round trip: put, ranged get, head, list, create-once, delete", "[s3]") {
  FERRY_S3_SERVER(server);
  auto c = client_for(server.config);
  auto d = s3::Deadline::in(30s);
  std::string b = testing::fresh_bucket();
  REQUIRE_OK(c->create_bucket(b, d));
  CHECK(c->create_bucket(b, d).ok());  // ours already

  std::string data = bytes_of(300'000, 1);
  const std::string key = "run 1/step-3/data+0 é.bin";  // needs encoding in the URL
  REQUIRE_OK(c->put(b, key, data.data(), data.size(), {}, d));

  std::string part(1000, '\0');
  auto got = c->get(b, key, 123'456, part.data(), part.size(), d);
  REQUIRE(got.ok());
  CHECK(got.value() == 1000);
  CHECK(part == data.substr(123'456, 1000));
  // Short at the end, nothing past it.
  auto tail = c->get(b, key, data.size() - 10, part.data(), part.size(), d);
  REQUIRE(tail.ok());
  CHECK(tail.value() == 10);
  auto past = c->get(b, key, data.size() + 5, part.data(), part.size(), d);
  REQUIRE(past.ok());
  CHECK(past.value() == 0);

  auto head = c->head(b, key, d);
  REQUIRE(head.ok());
  CHECK(head.value().size == data.size());
  auto all = c->get_all(b, key, 1 << 20, d);
  REQUIRE(all.ok());
  CHECK(all.value() == data);
  auto capped = c->get_all(b, key, 1000, d);
  REQUIRE_FALSE(capped.ok());
  CHECK(capped.status().message().find("300000 bytes") != std::string::npos);

  s3::PutOptions once;
  once.if_absent = true;
  REQUIRE_OK(c->put(b, "run 1/MANIFEST", "m1", 2, once, d));
  Status again = c->put(b, "run 1/MANIFEST", "m2", 2, once, d);
  CHECK(again.code() == StatusCode::already_exists);
  CHECK(again.message().find("s3://" + b + "/run 1/MANIFEST") != std::string::npos);
  CHECK(again.message().find("412") != std::string::npos);
  CHECK(c->get_all(b, "run 1/MANIFEST", 100, d).value() == "m1");

  auto missing = c->head(b, "run 1/nothing", d);
  CHECK(missing.status().code() == StatusCode::not_found);
  auto missing_get = c->get(b, "run 1/nothing", 0, part.data(), 10, d);
  CHECK(missing_get.status().code() == StatusCode::not_found);
  CHECK(missing_get.status().message().find("NoSuchKey") != std::string::npos);

  REQUIRE_OK(c->put(b, "other/x", "x", 1, {}, d));
  auto listed = c->list(b, "run 1/", d);
  REQUIRE(listed.ok());
  REQUIRE(listed.value().size() == 2);
  CHECK(listed.value()[0].key == "run 1/MANIFEST");
  CHECK(listed.value()[1].key == key);
  CHECK(listed.value()[1].size == data.size());

  REQUIRE_OK(c->remove(b, {key, "run 1/MANIFEST", "run 1/never-there"}, d));
  CHECK(c->list(b, "run 1/", d).value().empty());
  CHECK(c->list(b, "", d).value().size() == 1);
}

TEST_CASE("listing follows continuations past 1,000 keys", "[s3]") {
  FERRY_S3_SERVER(server);
  auto c = client_for(server.config);
  auto d = s3::Deadline::in(60s);
  std::string b = testing::fresh_bucket();
  REQUIRE_OK(c->create_bucket(b, d));
  const int n = 1030;
  std::vector<std::thread> threads;
  std::atomic<int> failed{0};
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int i = t; i < n; i += 8) {
        char key[32];
        std::snprintf(key, sizeof key, "p/%05d", i);
        if (!c->put(b, key, key, 7, {}, d).ok()) ++failed;
      }
    });
  for (auto& t : threads) t.join();
  REQUIRE(failed == 0);
  auto listed = c->list(b, "p/", d);
  REQUIRE(listed.ok());
  REQUIRE(listed.value().size() == n);
  for (int i = 0; i < n; ++i) {
    char key[32];
    std::snprintf(key, sizeof key, "p/%05d", i);
    CHECK(listed.value()[i].key == key);
  }
}

TEST_CASE("multipart uploads complete into one object, and aborted ones leave nothing", "[s3]") {
  FERRY_S3_SERVER(server);
  auto c = client_for(server.config);
  auto d = s3::Deadline::in(60s);
  std::string b = testing::fresh_bucket();
  REQUIRE_OK(c->create_bucket(b, d));
  const size_t part = 5u << 20;  // S3's smallest part but the last
  std::string data = bytes_of(2 * part + 12345, 7);

  auto id = c->create_multipart(b, "step-1/data-0", d);
  REQUIRE(id.ok());
  auto pending = c->list_multipart(b, "step-1/", d);
  REQUIRE(pending.ok());
  REQUIRE(pending.value().size() == 1);
  CHECK(pending.value()[0].upload_id == id.value());
  // Parts may arrive in any order.
  std::vector<std::string> etags(3);
  for (int p : {3, 1, 2}) {
    size_t off = (p - 1) * part;
    size_t len = std::min(part, data.size() - off);
    auto etag = c->upload_part(b, "step-1/data-0", id.value(), p, data.data() + off, len, d);
    REQUIRE(etag.ok());
    etags[p - 1] = etag.value();
  }
  // Not visible before it completes.
  CHECK(c->head(b, "step-1/data-0", d).status().code() == StatusCode::not_found);
  REQUIRE_OK(c->complete_multipart(b, "step-1/data-0", id.value(), etags, d));
  auto all = c->get_all(b, "step-1/data-0", data.size(), d);
  REQUIRE(all.ok());
  CHECK(all.value() == data);
  CHECK(c->list_multipart(b, "step-1/", d).value().empty());

  auto id2 = c->create_multipart(b, "step-2/data-0", d);
  REQUIRE(id2.ok());
  REQUIRE_OK(c->upload_part(b, "step-2/data-0", id2.value(), 1, data.data(), part, d));
  REQUIRE_OK(c->abort_multipart(b, "step-2/data-0", id2.value(), d));
  CHECK(c->list_multipart(b, "step-2/", d).value().empty());
  CHECK(c->head(b, "step-2/data-0", d).status().code() == StatusCode::not_found);
  // Completing with a wrong part list fails naming the object.
  auto id3 = c->create_multipart(b, "step-3/data-0", d);
  REQUIRE(id3.ok());
  Status bad = c->complete_multipart(b, "step-3/data-0", id3.value(), {"\"nope\""}, d);
  CHECK_FALSE(bad.ok());
  CHECK(bad.message().find("s3://" + b + "/step-3/data-0") != std::string::npos);
}

TEST_CASE("wrong credentials fail naming the operation, object and status, never the secret",
          "[s3]") {
  FERRY_S3_SERVER(server);
  s3::Config wrong = server.config;
  wrong.secret_key = "not-the-secret-0123456789";
  auto c = client_for(wrong);
  Status s = c->put("ferry-nobucket", "k", "x", 1, {}, s3::Deadline::in(20s));
  REQUIRE_FALSE(s.ok());
  CHECK(s.message().find("PutObject s3://ferry-nobucket/k") != std::string::npos);
  CHECK(s.message().find("HTTP 403") != std::string::npos);
  CHECK(s.message().find(wrong.secret_key) == std::string::npos);
  CHECK(s.message().find("after") == std::string::npos);  // not retried
}

TEST_CASE("requests retry 503 SlowDown with backoff, then succeed", "[s3][faults]") {
  ScriptedPeer peer({http(503, "Slow Down", s3_error_body("SlowDown")),
                     http(503, "Slow Down", s3_error_body("SlowDown")),
                     http(200, "OK", "", "ETag: \"abc\"\r\n")});
  s3::Config cfg;
  cfg.endpoint = peer.endpoint();
  cfg.access_key = "k";
  cfg.secret_key = "s";
  auto c = client_for(cfg);
  Status s = c->put("bucket", "a", "xyz", 3, {}, s3::Deadline::in(10s));
  CHECK(s.ok());
  CHECK(peer.requests() == 3);
}

TEST_CASE("requests that keep failing stop after the attempts, naming status and code",
          "[s3][faults]") {
  ScriptedPeer peer({http(500, "Internal", s3_error_body("InternalError"))});
  s3::Config cfg;
  cfg.endpoint = peer.endpoint();
  cfg.max_attempts = 3;
  auto c = client_for(cfg);
  Status s = c->put("bucket", "a/b", "xyz", 3, {}, s3::Deadline::in(10s));
  REQUIRE_FALSE(s.ok());
  CHECK(peer.requests() == 3);
  CHECK(s.message().find("after 3 attempts") != std::string::npos);
  CHECK(s.message().find("PutObject s3://bucket/a/b: HTTP 500 InternalError") != std::string::npos);
}

TEST_CASE("a server that never answers ends at the deadline, naming the object", "[s3][faults]") {
  ScriptedPeer peer({"stall"});
  s3::Config cfg;
  cfg.endpoint = peer.endpoint();
  cfg.attempt_timeout_ms = 300;
  auto c = client_for(cfg);
  auto start = std::chrono::steady_clock::now();
  std::string buf(100, '\0');
  auto r = c->get("bucket", "step-1/MANIFEST", 0, buf.data(), buf.size(), s3::Deadline::in(1500ms));
  auto took = std::chrono::steady_clock::now() - start;
  REQUIRE_FALSE(r.ok());
  CHECK(took < 5s);
  CHECK(r.status().message().find("GetObject s3://bucket/step-1/MANIFEST") != std::string::npos);
  CHECK(peer.requests() >= 2);  // each stalled attempt ended and another began
}

TEST_CASE("a response larger than the range asked for is refused, not written past the buffer",
          "[s3][faults]") {
  std::string body(4096, 'z');
  ScriptedPeer peer({http(206, "Partial Content", body)});
  s3::Config cfg;
  cfg.endpoint = peer.endpoint();
  auto c = client_for(cfg);
  std::string buf(100, '\0');
  auto r = c->get("bucket", "k", 0, buf.data(), buf.size(), s3::Deadline::in(5s));
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::corruption);
  CHECK(r.status().message().find("more bytes than 100") != std::string::npos);
}
