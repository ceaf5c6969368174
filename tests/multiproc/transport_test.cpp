// The transport between real processes: rank 0 runs in the test process,
// the other ranks are ferry_transport_peer processes (fork + exec).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actors/transport.hpp"

#ifndef FERRY_TRANSPORT_PEER_PATH
#error "FERRY_TRANSPORT_PEER_PATH must name the ferry_transport_peer binary"
#endif

namespace {

using ferry::Status;
using ferry::StatusCode;
using ferry::Transport;
using ferry::TransportCallbacks;
using ferry::TransportOptions;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A peer process; SIGKILLed and reaped on destruction if still running.
class PeerProcess {
 public:
  PeerProcess(int rank, int world, uint16_t port, const std::string& mode,
              std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {FERRY_TRANSPORT_PEER_PATH,
                                     "--rank",
                                     std::to_string(rank),
                                     "--world",
                                     std::to_string(world),
                                     "--port",
                                     std::to_string(port),
                                     "--mode",
                                     mode};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      // Only async-signal-safe calls between fork and exec; a peer never
      // outlives a crashed test.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~PeerProcess() {
    if (pid_ > 0 && !exit_code_) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) { kill(pid_, sig); }

  // The exit code (128 + signal if killed), or nullopt if still running after timeout_s.
  std::optional<int> wait_exit(double timeout_s) {
    auto start = Clock::now();
    while (!exit_code_) {
      int status = 0;
      pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (since(start) > timeout_s) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return exit_code_;
  }

 private:
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
};

// Rank 0's side: accepts "hello N" as rank N, refuses anything else with the
// reply "refused", acks with "ack N", and records what arrives.
class Recorder {
 public:
  TransportCallbacks callbacks() {
    TransportCallbacks cb;
    cb.accept = [this](const std::string& hello, std::string* reply) -> ferry::Result<int32_t> {
      std::lock_guard<std::mutex> lock(mu_);
      if (hello.rfind("hello ", 0) != 0) {
        ++refused_;
        *reply = "refused";
        cv_.notify_all();
        return Status::invalid_argument("bad hello '" + hello + "'");
      }
      int32_t rank = std::stoi(hello.substr(6));
      *reply = "ack " + std::to_string(rank);
      return rank;
    };
    cb.on_frame = [this](int32_t from, std::string frame) {
      std::lock_guard<std::mutex> lock(mu_);
      if (frame == "hb") {
        ++heartbeats_[from];
      } else {
        frames_.emplace_back(from, std::move(frame));
      }
      cv_.notify_all();
    };
    cb.on_peer_failed = [this](int32_t rank, Status why) {
      std::lock_guard<std::mutex> lock(mu_);
      failed_.emplace(rank, std::make_pair(Clock::now(), std::move(why)));
      cv_.notify_all();
    };
    return cb;
  }

  // Waits until a frame from `from` equal to `bytes` arrived (and removes it).
  bool wait_frame(int32_t from, const std::string& bytes, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] {
      for (auto it = frames_.begin(); it != frames_.end(); ++it) {
        if (it->first == from && it->second == bytes) {
          frames_.erase(it);
          return true;
        }
      }
      return false;
    });
  }

  std::optional<std::pair<Clock::time_point, Status>> wait_failed(int32_t rank, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                           [&] { return failed_.count(rank) > 0; });
    if (!ok) return std::nullopt;
    return failed_.find(rank)->second;
  }

  bool wait_refused(int n, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                        [&] { return refused_ >= n; });
  }

  int heartbeats(int32_t from) {
    std::lock_guard<std::mutex> lock(mu_);
    return heartbeats_[from];
  }
  size_t failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int refused_ = 0;
  std::vector<std::pair<int32_t, std::string>> frames_;
  std::map<int32_t, int> heartbeats_;
  std::multimap<int32_t, std::pair<Clock::time_point, Status>> failed_;
};

std::unique_ptr<Transport> start_rank0(int world, Recorder& rec, uint16_t port = 0,
                                       double hb_interval = 0.1, double hb_timeout = 2) {
  TransportOptions o;
  o.rank = 0;
  o.world_size = world;
  o.port = port;
  o.heartbeat_interval_s = hb_interval;
  o.heartbeat_timeout_s = hb_timeout;
  auto t = Transport::start(o, "", "hb", rec.callbacks());
  REQUIRE(t.ok());
  return std::move(t).value();
}

std::vector<std::string> peer_timing(double hb_interval = 0.1, double hb_timeout = 2,
                                     double connect_timeout = 10) {
  return {"--hb-interval",     std::to_string(hb_interval),
          "--hb-timeout",      std::to_string(hb_timeout),
          "--connect-timeout", std::to_string(connect_timeout)};
}

// A TCP socket bound to a free loopback port and not listening: connecting
// to it is refused for as long as it is held.
class ReservedPort {
 public:
  ReservedPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    socklen_t len = sizeof(a);
    REQUIRE(getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
  }
  ~ReservedPort() { release(); }
  void release() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  uint16_t port() const { return port_; }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

}  // namespace

TEST_CASE("rank 0 accepts three peers and exchanges frames both ways, 32 MiB included",
          "[transport]") {
  Recorder rec;
  auto t = start_rank0(4, rec);
  REQUIRE(t->port() != 0);
  std::vector<std::unique_ptr<PeerProcess>> peers;
  for (int r = 1; r <= 3; ++r) {
    peers.push_back(std::make_unique<PeerProcess>(r, 4, t->port(), "echo", peer_timing()));
  }
  Status st = t->wait_peers(10);
  INFO(st.to_string());
  REQUIRE(st.ok());

  for (int r = 1; r <= 3; ++r) REQUIRE(t->send(r, "ping " + std::to_string(r)).ok());
  for (int r = 1; r <= 3; ++r) CHECK(rec.wait_frame(r, "ping " + std::to_string(r), 5));

  std::string big(32u << 20, '\0');
  std::mt19937_64 rng(42);
  for (size_t i = 0; i + 8 <= big.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(&big[i], &v, 8);
  }
  auto sent_at = Clock::now();
  REQUIRE(t->send(2, big).ok());
  CHECK(rec.wait_frame(2, big, 20));
  WARN("32 MiB round trip took " << since(sent_at) << " s");

  // Heartbeats flow from every peer (interval 0.1 s).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (int r = 1; r <= 3; ++r) CHECK(rec.heartbeats(r) > 0);
  CHECK(rec.failures() == 0);

  // Not part of the star, or no such rank.
  CHECK(t->send(0, "x").code() == StatusCode::invalid_argument);
  CHECK(t->send(4, "x").code() == StatusCode::invalid_argument);

  // Peers end when rank 0 goes away.
  t->stop();
  t->stop();  // idempotent
  CHECK(t->send(1, "x").code() == StatusCode::aborted);
  for (auto& p : peers) CHECK(p->wait_exit(5) == std::optional<int>(0));
}

TEST_CASE("a peer with a bad hello is refused and does not count", "[transport]") {
  Recorder rec;
  auto t = start_rank0(3, rec);
  PeerProcess bad(2, 3, t->port(), "bad-hello", peer_timing());
  REQUIRE(rec.wait_refused(1, 10));
  // The refused peer got the reply and hung up.
  CHECK(bad.wait_exit(5) == std::optional<int>(0));
  Status st = t->wait_peers(0.3);
  CHECK(st.code() == StatusCode::timeout);
  CHECK_THAT(st.message(), Catch::Contains("ranks 1, 2"));
  CHECK(t->send(2, "x").code() == StatusCode::not_found);

  PeerProcess p1(1, 3, t->port(), "echo", peer_timing());
  PeerProcess p2(2, 3, t->port(), "echo", peer_timing());
  st = t->wait_peers(10);
  INFO(st.to_string());
  CHECK(st.ok());
  CHECK(rec.failures() == 0);
}

TEST_CASE("a SIGKILLed peer is reported through on_peer_failed", "[transport]") {
  Recorder rec;
  auto t = start_rank0(2, rec);
  PeerProcess peer(1, 2, t->port(), "kill-self", peer_timing());
  REQUIRE(t->wait_peers(10).ok());
  REQUIRE(t->send(1, "ping").ok());
  REQUIRE(rec.wait_frame(1, "ping", 5));

  auto killed_at = Clock::now();
  peer.signal(SIGKILL);
  auto failed = rec.wait_failed(1, 5);
  REQUIRE(failed);
  double latency = std::chrono::duration<double>(failed->first - killed_at).count();
  INFO("detected after " << latency << " s: " << failed->second.to_string());
  CHECK(latency < 2.0);
  CHECK(failed->second.code() == StatusCode::aborted);
  CHECK_THAT(failed->second.message(), Catch::Contains("rank 1"));
  CHECK(t->send(1, "x").code() == StatusCode::aborted);
  CHECK(t->wait_peers(1).code() == StatusCode::aborted);
  CHECK(peer.wait_exit(2) == std::optional<int>(128 + SIGKILL));
  // Reported once, even though heartbeats keep coming due.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(rec.failures() == 1);
}

TEST_CASE("a peer killed by its own hand mid-stream is reported", "[transport]") {
  Recorder rec;
  auto t = start_rank0(2, rec);
  PeerProcess peer(1, 2, t->port(), "kill-self", peer_timing());
  REQUIRE(t->wait_peers(10).ok());
  auto sent_at = Clock::now();
  REQUIRE(t->send(1, "die").ok());
  auto failed = rec.wait_failed(1, 5);
  REQUIRE(failed);
  CHECK(std::chrono::duration<double>(failed->first - sent_at).count() < 2.0);
}

TEST_CASE("a SIGSTOPped peer is reported by heartbeat timeout", "[transport]") {
  Recorder rec;
  auto t = start_rank0(2, rec, 0, /*hb_interval=*/0.1, /*hb_timeout=*/1);
  PeerProcess peer(1, 2, t->port(), "stop-self", peer_timing(0.1, 1));
  REQUIRE(t->wait_peers(10).ok());
  // Alive and well past the timeout first: heartbeats keep it up.
  std::this_thread::sleep_for(std::chrono::milliseconds(1300));
  REQUIRE(rec.failures() == 0);

  auto frozen_at = Clock::now();
  REQUIRE(t->send(1, "freeze").ok());
  auto failed = rec.wait_failed(1, 5);
  REQUIRE(failed);
  double latency = std::chrono::duration<double>(failed->first - frozen_at).count();
  INFO("detected after " << latency << " s: " << failed->second.to_string());
  CHECK(failed->second.code() == StatusCode::timeout);
  CHECK_THAT(failed->second.message(), Catch::Contains("rank 1 silent"));
  CHECK(latency > 0.8);
  CHECK(latency < 2.5);
  peer.signal(SIGKILL);
}

TEST_CASE("a peer started before rank 0 listens connects within its deadline", "[transport]") {
  ReservedPort reserved;
  uint16_t port = reserved.port();
  reserved.release();
  PeerProcess peer(1, 2, port, "echo", peer_timing(0.1, 2, /*connect_timeout=*/10));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));

  Recorder rec;
  auto t = start_rank0(2, rec, port);
  CHECK(t->port() == port);
  Status st = t->wait_peers(10);
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(t->send(1, "late ping").ok());
  CHECK(rec.wait_frame(1, "late ping", 5));
  REQUIRE(t->send(1, "bye").ok());
  CHECK(peer.wait_exit(5) == std::optional<int>(0));
}

TEST_CASE("a rank whose rank 0 never appears fails wait_peers with a timeout", "[transport]") {
  ReservedPort nobody;  // held: connections to it are refused throughout
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Status> failure;
  TransportCallbacks cb;
  cb.on_peer_failed = [&](int32_t rank, Status why) {
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) failure = why;
    cv.notify_all();
  };
  TransportOptions o;
  o.rank = 1;
  o.world_size = 2;
  o.port = nobody.port();
  o.connect_timeout_s = 1;
  auto start = Clock::now();
  auto t = Transport::start(o, "hello 1", "hb", cb);
  REQUIRE(t.ok());

  // Before the connect deadline: a plain timeout naming rank 0.
  Status early = (*t)->wait_peers(0.2);
  CHECK(early.code() == StatusCode::timeout);
  CHECK_THAT(early.message(), Catch::Contains("rank 0"));
  CHECK((*t)->send(0, "x").code() == StatusCode::not_found);

  // After it: the connect failure itself.
  Status late = (*t)->wait_peers(10);
  double waited = since(start);
  INFO(late.to_string());
  CHECK(late.code() == StatusCode::timeout);
  CHECK_THAT(late.message(), Catch::Contains("could not connect to rank 0"));
  CHECK(waited > 0.9);
  CHECK(waited < 3);
  std::unique_lock<std::mutex> lock(mu);
  CHECK(cv.wait_for(lock, std::chrono::seconds(1), [&] { return failure.has_value(); }));
}

TEST_CASE("transport options are checked", "[transport]") {
  TransportOptions o;
  o.world_size = 2;
  o.rank = 2;
  CHECK(Transport::start(o, "", "", {}).status().code() == StatusCode::invalid_argument);
  o.rank = 1;
  o.port = 0;
  CHECK(Transport::start(o, "", "", {}).status().code() == StatusCode::invalid_argument);
  o.rank = 0;
  CHECK(Transport::start(o, "", "", {}).status().code() ==
        StatusCode::invalid_argument);  // no accept
  o.world_size = 1;
  o.heartbeat_timeout_s = 0.5;
  CHECK(Transport::start(o, "", "", {}).status().code() == StatusCode::invalid_argument);

  // A single-rank job: nothing to wait for, nothing to listen on.
  o.heartbeat_timeout_s = 10;
  auto t = Transport::start(o, "", "", {});
  REQUIRE(t.ok());
  CHECK((*t)->wait_peers(0).ok());
  CHECK((*t)->port() == 0);

  // A port already taken is an error of start(), naming the address.
  Recorder rec;
  auto first = start_rank0(2, rec);
  TransportOptions taken;
  taken.world_size = 2;
  taken.port = first->port();
  auto second = Transport::start(taken, "", "", rec.callbacks());
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == StatusCode::io_error);
  CHECK_THAT(second.status().message(), Catch::Contains(std::to_string(first->port())));
}
