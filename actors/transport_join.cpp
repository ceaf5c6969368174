// The join handshake on rank 0's TCP socket, both sides (hello, verdict, reply, rejoin),
// and a rank's connect to rank 0's worker: the only bytes read from outside the job.

#include "actors/transport_impl.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

namespace ferry {

using transport_detail::from_seconds;
using transport_detail::get_le;
using transport_detail::kFirstRetryDelay;
using transport_detail::kMaxAddressBytes;
using transport_detail::kMaxRetryDelay;
using transport_detail::kReadyAmId;
using transport_detail::put_le;

namespace {

// The handshake on rank 0's TCP socket (docs/protocol.md, "Joining").
constexpr char kHelloMagic[4] = {'F', 'R', 'Y', 'H'};
constexpr char kReplyMagic[4] = {'F', 'R', 'Y', 'A'};
constexpr uint8_t kHandshakeVersion = 2;
// magic, version, node length (u8), 2 reserved, hello length (u32 LE),
// address length (u32 LE); then hello, address, node
constexpr size_t kHelloHeaderBytes = 16;
// magic, version, verdict, 2 reserved, reply length, address length, session (u64 LE)
constexpr size_t kReplyHeaderBytes = 24;
constexpr uint8_t kVerdictAccepted = 0;
constexpr uint8_t kVerdictRefused = 1;
// A Join is a few hundred bytes: the caps leave room and keep the memory one
// connection can pin small (kMaxAddressBytes for the worker address).
constexpr uint32_t kMaxHelloBytes = 16 << 10;
constexpr uint32_t kMaxReplyBytes = 16 << 10;
// Unauthenticated connections served at once; more are closed at once, and
// their ranks retry. Bounds rank 0's memory and descriptors under a flood.
constexpr size_t kMaxHandshakes = 32;
constexpr int kListenBacklog = 128;
// Fairness of one loop turn against a flood or a firehose.
constexpr int kMaxAcceptsPerTurn = 64;
constexpr size_t kMaxDiscardPerTurn = 64 << 10;

uint16_t port_of(const sockaddr_storage& s) {
  if (s.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(s).sin_port);
  if (s.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(s).sin6_port);
  return 0;
}

std::string describe(const sockaddr_storage& s) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (s.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(s).sin_addr, host, sizeof(host));
  } else if (s.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(s).sin6_addr, host, sizeof(host));
  }
  return std::string(host) + ":" + std::to_string(port_of(s));
}

}  // namespace

Status Transport::Impl::open_listener() {
  const std::string where = opts_.host + ":" + std::to_string(opts_.port);
  listen_fd_ = socket(address_.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return Status::from_errno(errno, "socket", "rank 0 listening on " + where);
  // A restarted job reuses its port while the last run's connections sit in TIME_WAIT.
  int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(listen_fd_, reinterpret_cast<const sockaddr*>(&address_.storage), address_.length) !=
          0 ||
      listen(listen_fd_, kListenBacklog) != 0) {
    return Status::io_error("rank 0: cannot listen on " + where + ": " + std::strerror(errno));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return Status::from_errno(errno, "getsockname", "rank 0 listening on " + where);
  }
  port_ = port_of(bound);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  if (epoll_ctl(sock_epoll_, EPOLL_CTL_ADD, listen_fd_, &ev) != 0) {
    return Status::from_errno(errno, "epoll_ctl", "rank 0 listening socket");
  }
  return Status::ok_status();
}

void Transport::Impl::service_sockets() {
  epoll_event evs[64];
  int n = epoll_wait(sock_epoll_, evs, 64, 0);
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 == 0) {
      accept_connections();
    } else {
      service_handshake(evs[i].data.u64);
    }
  }
}

void Transport::Impl::watch(uint64_t id, const Handshake& h) {
  epoll_event ev{};
  ev.events =
      (h.stage == Handshake::connecting || h.stage == Handshake::sending) ? EPOLLOUT : EPOLLIN;
  ev.data.u64 = id;
  if (epoll_ctl(sock_epoll_, EPOLL_CTL_MOD, h.fd, &ev) != 0 &&
      epoll_ctl(sock_epoll_, EPOLL_CTL_ADD, h.fd, &ev) != 0) {
    log("epoll_ctl on a handshake socket: %s", std::strerror(errno));
  }
}

void Transport::Impl::close_handshake(uint64_t id) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  // Closing removes it from the epoll set: nobody else holds the descriptor.
  close(it->second.fd);
  handshakes_.erase(it);
  if (client_handshake_ == id) client_handshake_ = 0;
}

void Transport::Impl::accept_connections() {
  for (int i = 0; i < kMaxAcceptsPerTurn; ++i) {
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    int fd =
        accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        log_foreign("accept on port %u: %s", static_cast<unsigned>(port_), std::strerror(errno));
      }
      return;
    }
    if (handshakes_.size() >= kMaxHandshakes) {
      close(fd);
      log_foreign("closed a connection from %s: %zu handshakes already in progress",
                  describe(from).c_str(), handshakes_.size());
      continue;
    }
    uint64_t id = next_handshake_id_++;
    Handshake& h = handshakes_[id];
    h.fd = fd;
    h.from = describe(from);
    h.stage = Handshake::receiving;
    h.want = kHelloHeaderBytes;
    h.deadline = Clock::now() + from_seconds(opts_.handshake_timeout_s);
    watch(id, h);
  }
}

bool Transport::Impl::pump_out(Handshake& h) {
  while (h.sent < h.out.size()) {
    ssize_t n = ::send(h.fd, h.out.data() + h.sent, h.out.size() - h.sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    h.sent += static_cast<size_t>(n);
  }
  return true;
}

// Reads at most up to h.want (or, lingering, discards up to `limit` bytes).
// Returns 1 on progress or nothing to read yet, 0 at end of stream, -1 on error.
int Transport::Impl::pump_in(Handshake& h, size_t limit) {
  char buf[4096];
  size_t budget = limit;
  for (;;) {
    size_t room = h.stage == Handshake::lingering ? sizeof(buf) : h.want - h.in.size();
    room = std::min({room, sizeof(buf), budget});
    if (room == 0) return 1;
    ssize_t n = recv(h.fd, buf, room, 0);
    if (n == 0) return 0;
    if (n < 0) {
      if (errno == EINTR) continue;
      return (errno == EAGAIN || errno == EWOULDBLOCK) ? 1 : -1;
    }
    budget -= static_cast<size_t>(n);
    if (h.stage != Handshake::lingering) h.in.append(buf, static_cast<size_t>(n));
  }
}

void Transport::Impl::service_handshake(uint64_t id) {
  auto it = handshakes_.find(id);
  if (it == handshakes_.end()) return;
  Handshake& h = it->second;
  const bool client = id == client_handshake_;
  if (h.stage == Handshake::connecting) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(h.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return retry_connect(std::strerror(err));
    h.stage = Handshake::sending;
  }
  if (h.stage == Handshake::sending) {
    if (!pump_out(h)) {
      if (client) return retry_connect(std::string("sending the hello: ") + std::strerror(errno));
      log_foreign("closed a connection from %s: the reply could not be sent: %s", h.from.c_str(),
                  std::strerror(errno));
      return close_handshake(id);
    }
    if (h.sent < h.out.size()) return watch(id, h);
    if (client) {
      h.stage = Handshake::receiving;
      h.want = kReplyHeaderBytes;
      std::lock_guard<std::mutex> lock(mu_);
      hello_sent_ns_ = Clock::now().time_since_epoch() / std::chrono::nanoseconds(1);
    } else {
      // Our half closed, theirs read until they hang up: closing with their
      // bytes unread would reset the connection and could destroy the reply.
      shutdown(h.fd, SHUT_WR);
      h.stage = Handshake::lingering;
    }
    watch(id, h);
  }
  if (h.stage == Handshake::lingering) {
    if (pump_in(h, kMaxDiscardPerTurn) <= 0) close_handshake(id);
    return;
  }
  // receiving
  const size_t header = client ? kReplyHeaderBytes : kHelloHeaderBytes;
  int r = pump_in(h, SIZE_MAX);
  if (!h.header_checked && h.in.size() == header) {
    h.header_checked = true;
    // Every length is checked here, before a byte of what it announces is read.
    const char* magic = client ? kReplyMagic : kHelloMagic;
    uint32_t body = static_cast<uint32_t>(get_le(&h.in[8], 4));
    uint32_t addr = static_cast<uint32_t>(get_le(&h.in[12], 4));
    // The hello's node length is a byte: never over kMaxNodeBytes.
    uint32_t node = client ? 0 : static_cast<uint8_t>(h.in[5]);
    const uint32_t max_body = client ? kMaxReplyBytes : kMaxHelloBytes;
    std::string bad;
    if (std::memcmp(h.in.data(), magic, 4) != 0) {
      bad = "not a Ferry handshake";
    } else if (static_cast<uint8_t>(h.in[4]) != kHandshakeVersion) {
      bad = "handshake version " + std::to_string(static_cast<uint8_t>(h.in[4])) + ", expected " +
            std::to_string(kHandshakeVersion);
    } else if (body > max_body) {
      bad = "announced " + std::to_string(body) + " bytes of hello, the limit is " +
            std::to_string(max_body);
    } else if (addr > kMaxAddressBytes || (!client && addr == 0)) {
      bad = "announced a " + std::to_string(addr) + "-byte worker address, the limit is " +
            std::to_string(kMaxAddressBytes);
    }
    if (!bad.empty()) {
      if (client) return retry_connect("rank 0's reply: " + bad);
      log_foreign("closed a connection from %s: %s", h.from.c_str(), bad.c_str());
      return close_handshake(id);
    }
    h.want = header + body + addr + node;
    if (r > 0) r = pump_in(h, SIZE_MAX);
  }
  if (h.header_checked && h.in.size() == h.want) {
    return client ? on_reply(id) : on_hello(id);
  }
  if (r <= 0) {
    std::string why = r == 0 ? "closed" : std::strerror(errno);
    if (client) return retry_connect("rank 0 " + why + " the connection before its reply");
    log_foreign("closed a connection from %s: it went away after %zu bytes of its hello (%s)",
                h.from.c_str(), h.in.size(), why.c_str());
    close_handshake(id);
  }
}

void Transport::Impl::on_hello(uint64_t id) {
  Handshake& h = handshakes_.at(id);
  const uint32_t body = static_cast<uint32_t>(get_le(&h.in[8], 4));
  const uint32_t addr = static_cast<uint32_t>(get_le(&h.in[12], 4));
  const std::string hello = h.in.substr(kHelloHeaderBytes, body);
  const std::string address = h.in.substr(kHelloHeaderBytes + body, addr);
  const std::string node = h.in.substr(kHelloHeaderBytes + body + addr);
  std::string reply;
  Result<int32_t> verdict = cb_.accept(hello, &reply);
  if (reply.size() > kMaxReplyBytes) reply.resize(kMaxReplyBytes);
  std::string out(kReplyMagic, 4);
  out.push_back(static_cast<char>(kHandshakeVersion));
  if (!verdict.ok()) {
    log_foreign("refused a connection from %s: %s", h.from.c_str(),
                verdict.status().to_string().c_str());
    if (reply.empty()) return close_handshake(id);
    out.push_back(static_cast<char>(kVerdictRefused));
    out.append(2, '\0');
    put_le(&out, reply.size(), 4);
    put_le(&out, 0, 4);
    put_le(&out, 0, 8);
    out += reply;
  } else {
    int32_t rank = *verdict;
    bool valid = rank >= 1 && rank < opts_.world_size;
    // A rank we failed (a partition, say) may come back with the job's
    // token: it gets a fresh session, so late messages of its old one stay dropped.
    bool rejoin = false;
    if (valid) {
      std::lock_guard<std::mutex> lock(mu_);
      rejoin = peers_[rank].state == PeerInfo::failed;
      valid = peers_[rank].state == PeerInfo::absent || rejoin;
    }
    if (!valid) {
      log_foreign(
          "refused a connection from %s: accept() gave rank %d, which is out of range or "
          "already joined",
          h.from.c_str(), rank);
      return close_handshake(id);
    }
    uint64_t session = 0;
    while (session == 0 || issued_.count(session) != 0) session = rng_();
    issued_.insert(session);
    Result<Conn*> conn = connect_to(rank, address, session);
    if (!conn.ok()) {
      log("refused rank %d from %s: %s", rank, h.from.c_str(), conn.status().to_string().c_str());
      return close_handshake(id);
    }
    out.push_back(static_cast<char>(kVerdictAccepted));
    out.append(2, '\0');
    put_le(&out, reply.size(), 4);
    put_le(&out, my_address_.size(), 4);
    put_le(&out, session, 8);
    out += reply;
    out += my_address_;
    joined_address_[rank] = address;
    joined_node_[rank] = node;
    bool all = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_[rank].state = PeerInfo::up;
      peers_[rank].why = Status();
      all = all_peers_up_locked();
      cv_.notify_all();
    }
    if (rejoin) {
      reported_[rank] = false;
      log("rank %d rejoined from %s with a new session", rank, h.from.c_str());
      if (!stopping_ && cb_.on_peer_rejoined) cb_.on_peer_rejoined(rank);
    } else if (all) {
      // Before wait_peers() can return here: the lanes reach every rank
      // ahead of any frame the layer above sends it once all joined.
      distribute_lanes();
    }
  }
  h.in.clear();
  h.in.shrink_to_fit();
  h.out = std::move(out);
  h.sent = 0;
  h.stage = Handshake::sending;
  service_handshake(id);
}

void Transport::Impl::on_reply(uint64_t id) {
  Handshake& h = handshakes_.at(id);
  const uint8_t verdict = static_cast<uint8_t>(h.in[5]);
  const uint32_t body = static_cast<uint32_t>(get_le(&h.in[8], 4));
  const uint64_t session = get_le(&h.in[16], 8);
  std::string reply = h.in.substr(kReplyHeaderBytes, body);
  const std::string address = h.in.substr(kReplyHeaderBytes + body);
  if (verdict == kVerdictAccepted && (address.empty() || session == 0)) {
    return retry_connect("rank 0's reply: accepted without a worker address or session");
  }
  if (verdict != kVerdictAccepted && verdict != kVerdictRefused) {
    return retry_connect("rank 0's reply: unknown verdict " + std::to_string(verdict));
  }
  close_handshake(id);
  if (rejoining_ && verdict != kVerdictAccepted) {
    // The reply is a JoinAck with rank 0's reason; the job goes on without it.
    log("rank 0 refused this rank's rejoin; rank 0 stays failed");
    rejoining_ = false;
    return;
  }
  connected_once_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reply_ns_ = Clock::now().time_since_epoch() / std::chrono::nanoseconds(1);
  }
  if (verdict == kVerdictAccepted) {
    const auto now = Clock::now();
    // Rank 0 fails a rank that has not reached it heartbeat_timeout_s after
    // its accept; leave its first message time to arrive before that.
    pending_join_ = PendingJoin{address, session, std::move(reply),
                                now + from_seconds(0.8 * opts_.heartbeat_timeout_s)};
    retry_delay_ = kFirstRetryDelay;
    return connect_rank0(now);
  }
  finish_join(/*refused=*/true, std::move(reply));
}

// UCX's connect to rank 0's worker can be refused although rank 0 is up and
// just answered (seen once in CI on loopback; UCX retries such a refusal
// only when it comes asynchronously): try again until rank 0 would give up.
void Transport::Impl::connect_rank0(Clock::time_point now) {
  PendingJoin& p = *pending_join_;
  ++p.attempts;
  Result<Conn*> conn = connect_to(0, p.address, p.session);
  if (!conn.ok()) {
    if (now >= p.deadline && rejoining_) {
      rejoin_failed(conn.status().message());
      pending_join_.reset();
      next_attempt_ = now + retry_delay_;
      return;
    }
    if (now >= p.deadline) {
      Status why = Status::io_error(conn.status().message() + " (" + std::to_string(p.attempts) +
                                    " attempts)");
      pending_join_.reset();
      return fail_peer(0, std::move(why));
    }
    if (p.attempts == 1) log("%s; trying again", conn.status().message().c_str());
    next_attempt_ = now + retry_delay_;
    retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
    return;
  }
  send_am(*conn, kReadyAmId, std::string());
  std::string reply = std::move(p.reply);
  pending_join_.reset();
  finish_join(/*refused=*/false, std::move(reply));
}

void Transport::Impl::finish_join(bool refused, std::string reply) {
  {
    // Rank 0 is up before on_frame runs (so it may answer with send()), but
    // wait_peers() returns only after it, so the layer above has seen the
    // ack by then.
    std::lock_guard<std::mutex> lock(mu_);
    peers_[0].state = PeerInfo::up;
    refused_ = refused;
  }
  if (!stopping_ && cb_.on_frame && !reply.empty()) cb_.on_frame(0, std::move(reply));
  {
    std::lock_guard<std::mutex> lock(mu_);
    ack_delivered_ = true;
    cv_.notify_all();
  }
  if (rejoining_ && !refused) {
    rejoining_ = false;
    reported_[0] = false;
    log("rejoined rank 0 with a new session");
    if (!stopping_ && cb_.on_peer_rejoined) cb_.on_peer_rejoined(0);
  }
}

void Transport::Impl::connect_attempt(Clock::time_point now) {
  ++attempts_;
  int fd = socket(address_.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    last_connect_error_ = std::string("socket: ") + std::strerror(errno);
    next_attempt_ = now + retry_delay_;
    retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
    return;
  }
  uint64_t id = next_handshake_id_++;
  Handshake& h = handshakes_[id];
  h.fd = fd;
  h.from = describe(address_.storage);
  // A rejoin's attempts each have their own deadline; all together, rejoin_timeout_s.
  h.deadline = rejoining_ ? now + from_seconds(opts_.handshake_timeout_s) : connect_deadline_;
  h.out.assign(kHelloMagic, 4);
  h.out.push_back(static_cast<char>(kHandshakeVersion));
  h.out.push_back(static_cast<char>(node_.size()));
  h.out.append(2, '\0');
  put_le(&h.out, hello_.size(), 4);
  put_le(&h.out, my_address_.size(), 4);
  h.out += hello_;
  h.out += my_address_;
  h.out += node_;
  client_handshake_ = id;
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&address_.storage), address_.length);
  if (rc != 0 && errno != EINPROGRESS) return retry_connect(std::strerror(errno));
  h.stage = rc == 0 ? Handshake::sending : Handshake::connecting;
  watch(id, h);
}

void Transport::Impl::retry_connect(const std::string& why) {
  if (client_handshake_ != 0) close_handshake(client_handshake_);
  last_connect_error_ = why;
  if (rejoining_) rejoin_failed(why);
  next_attempt_ = Clock::now() + retry_delay_;
  retry_delay_ = std::min<Clock::duration>(retry_delay_ * 2, kMaxRetryDelay);
}

}  // namespace ferry
