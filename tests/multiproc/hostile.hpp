// Bytes from outside a job: what a port scanner, a confused client or an
// attacker sends to the ports a rank listens on, the connections that carry
// them, and where a process listens. Shared by the loopback transport test
// and the many-host test's sender on another host (foreign_sender.cpp).
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace ferry::testing {

// The hello's handshake version (docs/protocol.md, "Joining"): payloads with
// another one are refused before their lengths or their Join are looked at.
constexpr char kHelloVersion = 2;

// The TCP sockets `pid` listens on, found from the process itself (its socket
// descriptors matched against the kernel's socket tables of its network
// namespace), not from what it announces. Wildcard addresses are reached
// through loopback, or at `wildcard_v4` (an IPv4 address, either family's
// wildcard: a v6 one takes v4 too) when given.
inline std::vector<sockaddr_storage> listening_sockets(pid_t pid,
                                                       const std::string& wildcard_v4 = "") {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  if (DIR* d = opendir(fd_dir.c_str())) {
    while (dirent* e = readdir(d)) {
      char target[64] = {0};
      std::string link = fd_dir + "/" + e->d_name;
      if (readlink(link.c_str(), target, sizeof(target) - 1) <= 0) continue;
      std::string t = target;
      if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
    }
    closedir(d);
  }
  std::vector<sockaddr_storage> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/net/" + table);
    std::string line;
    std::getline(in, line);  // the column names
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, timer, retrans, uid, timeout, inode;
      f >> sl >> local >> remote >> state >> queues >> timer >> retrans >> uid >> timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      size_t colon = local.find(':');
      std::string host = local.substr(0, colon);
      uint16_t port = static_cast<uint16_t>(std::stoul(local.substr(colon + 1), nullptr, 16));
      sockaddr_storage a{};
      const bool any = host.find_first_not_of('0') == std::string::npos;
      if (any && !wildcard_v4.empty()) {
        auto* in4 = reinterpret_cast<sockaddr_in*>(&a);
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
        inet_pton(AF_INET, wildcard_v4.c_str(), &in4->sin_addr);
      } else if (host.size() == 8) {
        auto* in4 = reinterpret_cast<sockaddr_in*>(&a);
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
        // The kernel prints the address as the 32-bit word it stores.
        in4->sin_addr.s_addr = static_cast<uint32_t>(std::stoul(host, nullptr, 16));
        if (in4->sin_addr.s_addr == htonl(INADDR_ANY))
          in4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      } else {
        auto* in6 = reinterpret_cast<sockaddr_in6*>(&a);
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
        for (int w = 0; w < 4; ++w) {
          uint32_t word = static_cast<uint32_t>(std::stoul(host.substr(8 * w, 8), nullptr, 16));
          std::memcpy(&in6->sin6_addr.s6_addr[4 * w], &word, 4);
        }
        if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) in6->sin6_addr = in6addr_loopback;
      }
      out.push_back(a);
    }
  }
  return out;
}

inline uint16_t port_of(const sockaddr_storage& a) {
  return ntohs(a.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in&>(a).sin_port
                                      : reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
}

inline std::string ports_text(const std::vector<sockaddr_storage>& all) {
  std::string out;
  for (const auto& a : all) out += (out.empty() ? "" : ", ") + std::to_string(port_of(a));
  return out;
}

// A connected socket; closed on destruction. CLOEXEC, so that a peer started
// while it is open does not keep the connection alive.
class Connection {
 public:
  explicit Connection(const sockaddr_storage& to) {
    fd_ = socket(to.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t len = to.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (fd_ >= 0 && connect(fd_, reinterpret_cast<const sockaddr*>(&to), len) != 0) {
      close(fd_);
      fd_ = -1;
    }
    if (fd_ >= 0) {
      // A listener that stops reading must not hang the test.
      timeval tv{2, 0};
      setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    }
  }
  ~Connection() {
    if (fd_ >= 0) close(fd_);
  }
  Connection(Connection&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Connection(const Connection&) = delete;

  bool ok() const { return fd_ >= 0; }
  // Errors are expected: the other side may close as soon as it has seen enough.
  void write_all(const std::string& bytes) {
    size_t off = 0;
    while (fd_ >= 0 && off < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += static_cast<size_t>(n);
    }
  }
  // Whether the other side closed (end of stream or reset) within timeout_s;
  // what it sent before goes to *received (at most 64 KiB), if given.
  bool closed_by_peer(double timeout_s, std::string* received = nullptr) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[512];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return true;
      if (received != nullptr && received->size() < (64u << 10))
        received->append(buf, static_cast<size_t>(n));
    }
    return false;
  }

 private:
  int fd_ = -1;
};

inline std::string le32(uint32_t v) {
  std::string out;
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return out;
}

// What a port scanner, a confused client or an attacker might send.
inline std::vector<std::pair<std::string, std::string>> hostile_payloads() {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("nothing", "");
  // Trips UCX 1.13's socket connection manager (an assertion in tcp_sockcm_ep.c).
  out.emplace_back("0x10 + 40 zeros", std::string(1, '\x10') + std::string(40, '\0'));
  out.emplace_back("4096 zeros", std::string(4096, '\0'));
  out.emplace_back("an HTTP request",
                   "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
  out.emplace_back("64 x 'A'", std::string(64, 'A'));
  out.emplace_back("a huge length prefix", std::string(8, '\xff') + std::string(56, '\x7f'));
  out.emplace_back("a UCX tcp header announcing 4 GiB",
                   std::string(1, '\x20') + std::string(4, '\xff') + std::string(64, '\0'));
  // Ferry's own handshake, but lying about its lengths or its token.
  const std::string hello_head = std::string("FRYH") + kHelloVersion + std::string(3, '\0');
  out.emplace_back("a Ferry hello announcing 4 GiB",
                   hello_head + le32(0xffffffffu) + le32(0xffffffffu) + std::string(64, 'h'));
  out.emplace_back("a Ferry hello with a bad version",
                   std::string("FRYH\x07\0\0\0", 8) + le32(4) + le32(4) + "abcdwxyz");
  out.emplace_back("a Ferry hello, truncated", hello_head + le32(1000) + le32(100) + "hello 1");
  out.emplace_back("a Ferry hello with a wrong token",
                   hello_head + le32(10) + le32(8) + "not a join" + std::string(8, '\x01'));
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    std::mt19937 rng(seed);
    for (size_t n : {size_t{1}, size_t{7}, size_t{16}, size_t{41}, size_t{1000}, size_t{65536}}) {
      std::string bytes(n, '\0');
      for (char& c : bytes) c = static_cast<char>(rng());
      out.emplace_back("seed " + std::to_string(seed) + ", " + std::to_string(n) + " random bytes",
                       std::move(bytes));
    }
  }
  return out;
}

// A Ferry hello around `body` (what accept() sees) with a worker address of
// `address`: a handshake that passes every length check.
inline std::string ferry_hello(const std::string& body, const std::string& address) {
  return std::string("FRYH") + kHelloVersion + std::string(3, '\0') +
         le32(static_cast<uint32_t>(body.size())) + le32(static_cast<uint32_t>(address.size())) +
         body + address;
}

}  // namespace ferry::testing
