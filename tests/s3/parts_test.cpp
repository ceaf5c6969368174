// A data object's parts in flight: several at once from one writer thread,
// each block's write ending only once its part is stored, and a part that
// fails losing the upload (the rest fail at once, finish fails naming the
// object, the upload is aborted). Against an HTTP peer on loopback that
// answers the multipart calls and holds every part until `want` are open
// at once, so overlap is seen by the server, not guessed from timings.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "object_fs.hpp"
#include "s3/s3_store.hpp"
#include "s3_server.hpp"
#include "storage_writer.hpp"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

class PartsPeer {
 public:
  // Parts are answered once `want` were open at once (or after 10 s, so a
  // writer that sends one at a time fails the test instead of hanging it).
  // Part `fail_part` answers 403; part `slow_part` answers 503 SlowDown once.
  PartsPeer(int want, int fail_part, int slow_part)
      : want_(want), fail_part_(fail_part), slow_part_(slow_part) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    REQUIRE(listen(fd_, 64) == 0);
    accept_ = std::thread([this] { serve(); });
  }
  ~PartsPeer() {
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    accept_.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : conns_) t.join();
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

  std::mutex mu_;
  int peak_ = 0;
  int completes_ = 0;
  int aborts_ = 0;
  std::map<int, int> tries_;  // part number -> requests

 private:
  void serve() {
    for (;;) {
      int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::lock_guard<std::mutex> lock(mu_);
      conns_.emplace_back([this, c] {
        answer(c);
        close(c);
      });
    }
  }

  void answer(int c) {
    std::string req;
    char buf[65536];
    while (req.find("\r\n\r\n") == std::string::npos) {
      ssize_t n = read(c, buf, sizeof buf);
      if (n <= 0) return;
      req.append(buf, static_cast<size_t>(n));
    }
    const size_t head_end = req.find("\r\n\r\n") + 4;
    size_t body = 0;
    auto cl = req.find("Content-Length: ");
    if (cl != std::string::npos) body = std::strtoull(req.c_str() + cl + 16, nullptr, 10);
    if (req.find("Expect: 100-continue") != std::string::npos && req.size() == head_end)
      send(c, "HTTP/1.1 100 Continue\r\n\r\n");
    size_t have = req.size() - head_end;
    while (have < body) {
      ssize_t n = read(c, buf, std::min(sizeof buf, body - have));
      if (n <= 0) return;
      have += static_cast<size_t>(n);
    }
    const std::string line = req.substr(0, req.find("\r\n"));
    if (line.rfind("POST", 0) == 0 && line.find("?uploads") != std::string::npos)
      return send(c, http(200,
                          "<InitiateMultipartUploadResult><UploadId>u1</UploadId>"
                          "</InitiateMultipartUploadResult>"));
    if (line.rfind("POST", 0) == 0) {
      std::lock_guard<std::mutex> lock(mu_);
      ++completes_;
      return send(c, http(200, "<CompleteMultipartUploadResult></CompleteMultipartUploadResult>"));
    }
    if (line.rfind("DELETE", 0) == 0) {
      std::lock_guard<std::mutex> lock(mu_);
      ++aborts_;
      return send(c, "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n");
    }
    if (line.rfind("HEAD", 0) == 0)
      return send(c, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    auto pn = line.find("partNumber=");
    if (line.rfind("PUT", 0) != 0 || pn == std::string::npos)
      return send(c, http(400, "<Error><Code>Unexpected</Code></Error>"));
    const int number = std::atoi(line.c_str() + pn + 11);
    int attempt = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      attempt = ++tries_[number];
      ++open_;
      peak_ = std::max(peak_, open_);
      all_open_.notify_all();
      all_open_.wait_for(lock, 10s, [&] { return peak_ >= want_; });
      --open_;
    }
    if (number == fail_part_)
      return send(c, http(403, "<Error><Code>AccessDenied</Code><Message>no</Message></Error>"));
    if (number == slow_part_ && attempt == 1)
      return send(c, http(503, "<Error><Code>SlowDown</Code><Message>later</Message></Error>"));
    send(c, http(200, "", "ETag: \"e" + std::to_string(number) + "\"\r\n"));
  }

  static std::string http(int code, const std::string& body, const std::string& extra = "") {
    return "HTTP/1.1 " + std::to_string(code) +
           " X\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n" +
           extra + "\r\n" + body;
  }
  static void send(int c, const std::string& s) { (void)!write(c, s.data(), s.size()); }

  const int want_, fail_part_, slow_part_;
  int fd_ = -1;
  int port_ = 0;
  int open_ = 0;
  std::condition_variable all_open_;
  std::vector<std::thread> conns_;
  std::thread accept_;
};

constexpr size_t kPart = 5u << 20;

// A data file "s3://bucket/run/data" on the peer, written as a save's
// writer does (open exclusive, blocks of one part each).
struct Rig {
  explicit Rig(PartsPeer& peer, int in_flight) {
    S3StoreOptions o;
    o.client.endpoint = peer.endpoint();
    o.client.access_key = "AK";
    o.client.secret_key = "SK";
    o.client.connections = in_flight + 2;
    o.part_bytes = kPart;
    o.parts_in_flight = in_flight;
    o.op_timeout_ms = 30'000;
    auto store = s3_store("s3://bucket/run", o);
    REQUIRE_OK(store);
    fs = store_filesystem(store.value());
    writer = std::make_unique<PosixStorageWriter>(fs, false, false);
    auto files = writer->open_checkpoint({"s3://bucket/run/data"});
    REQUIRE_OK(files);
    file = files.value()[0];
    for (int i = 0; i < 6; ++i) blocks.emplace_back(kPart, static_cast<char>('a' + i));
  }
  // Writes block `i` at part `i`; its outcome lands in `done[i]`.
  void write(int i) {
    writer->write_async(*file, blocks[i].data(), kPart, i * kPart, [this, i](Status s) {
      std::lock_guard<std::mutex> lock(mu);
      done[i] = std::move(s);
      cv.notify_all();
    });
  }
  bool wait(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, 30s, [&] { return done.size() >= n; });
  }
  size_t landed() {
    std::lock_guard<std::mutex> lock(mu);
    return done.size();
  }

  std::shared_ptr<Filesystem> fs;
  std::unique_ptr<PosixStorageWriter> writer;
  std::shared_ptr<File> file;
  std::vector<std::string> blocks;
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, Status> done;
};

}  // namespace

TEST_CASE("one writer keeps several parts in flight, each write ending when its part is stored",
          "[s3][parts]") {
  PartsPeer peer(/*want=*/4, /*fail_part=*/0, /*slow_part=*/3);
  Rig rig(peer, 4);
  // The peer holds parts until four are open: none of the first three
  // writes may end (its block would go back to the pool unsent).
  for (int i = 0; i < 3; ++i) rig.write(i);
  CHECK(rig.landed() == 0);
  rig.write(3);
  REQUIRE(rig.wait(4));
  for (auto& [i, s] : rig.done) {
    INFO("part " << i + 1 << ": " << s.to_string());
    CHECK(s.ok());
  }
  REQUIRE_OK(rig.writer->finish_file(0, rig.file.get(), 4 * kPart));
  std::lock_guard<std::mutex> lock(peer.mu_);
  CHECK(peer.peak_ == 4);
  CHECK(peer.tries_[3] == 2);  // the 503 SlowDown was retried
  CHECK(peer.completes_ == 1);
  CHECK(peer.aborts_ == 0);
}

TEST_CASE(
    "a part that fails in flight fails the writes after it and aborts the upload, naming "
    "the object",
    "[s3][parts]") {
  PartsPeer peer(/*want=*/4, /*fail_part=*/2, /*slow_part=*/0);
  Rig rig(peer, 4);
  for (int i = 0; i < 4; ++i) rig.write(i);
  REQUIRE(rig.wait(4));
  const Status failed = rig.done[1];
  INFO(failed.to_string());
  REQUIRE_FALSE(failed.ok());
  CHECK(failed.message().find("s3://bucket/run/data") != std::string::npos);
  CHECK(failed.message().find("UploadPart") != std::string::npos);
  CHECK(failed.message().find("part 2") != std::string::npos);
  CHECK(failed.message().find("403") != std::string::npos);
  CHECK(rig.done[0].ok());
  // The upload is lost: a later part is not sent, and finishing fails with the cause.
  rig.write(4);
  REQUIRE(rig.wait(5));
  CHECK(rig.done[4].message() == failed.message());
  Status finished = rig.writer->finish_file(0, rig.file.get(), 5 * kPart);
  CHECK(finished.message() == failed.message());
  std::lock_guard<std::mutex> lock(peer.mu_);
  CHECK(peer.peak_ == 4);
  CHECK(peer.tries_.count(5) == 0);
  CHECK(peer.completes_ == 0);
  CHECK(peer.aborts_ == 1);
}
