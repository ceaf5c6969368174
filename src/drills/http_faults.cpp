// FERRY_FAULTS http: rules and the fault peer that plays the failing server.
#include "drills/http_faults.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <thread>

#include "drills/fault_fs.hpp"
#include "drills/fields.hpp"

namespace ferry {
namespace {

using drills::parse_u64;
using drills::split;

const char* const kOps[] = {"put",      "get",   "head",   "list",    "part",   "create",
                            "complete", "abort", "delete", "uploads", "bucket", "any"};

Status bad(const std::string& item, const std::string& why) {
  return Status::invalid_argument("fault spec: '" + item + "': " + why);
}

bool key_matches(const std::string& filter, const std::string& key) {
  if (filter.empty()) return true;
  if (filter.back() == '$') {
    const size_t n = filter.size() - 1;
    return key.size() >= n && key.compare(key.size() - n, n, filter, 0, n) == 0;
  }
  return key.find(filter) != std::string::npos;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads until the client closes (it gave up, or it read the answer), so the
// answer is never cut by a reset while the client still sends its body.
void drain(int fd, int poll_ms) {
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, poll_ms);
    if (r == 0 && poll_ms >= 0) return;
    if (r < 0) return;
    if (::read(fd, buf, sizeof buf) <= 0) return;
  }
}

// The request's head: "GET /ferry-fault/... HTTP/1.1" and its headers.
std::string read_head(int fd) {
  std::string head;
  char buf[4096];
  while (head.find("\r\n\r\n") == std::string::npos && head.size() < (64u << 10)) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10'000) <= 0) break;
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    head.append(buf, static_cast<size_t>(n));
  }
  return head;
}

std::string header_value(const std::string& head, const std::string& lower_name) {
  std::string lower = head;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto at = lower.find("\r\n" + lower_name + ":");
  if (at == std::string::npos) return "";
  auto start = at + 3 + lower_name.size();
  auto end = head.find("\r\n", start);
  std::string v = head.substr(start, end - start);
  v.erase(0, v.find_first_not_of(' '));
  return v;
}

// Answers one connection as its URL says: /ferry-fault/ACTION/STATUS/CODE.
void answer(int fd) {
  const std::string head = read_head(fd);
  const std::string method = head.substr(0, head.find(' '));
  const auto path_start = head.find(' ') + 1;
  const std::string path = head.substr(path_start, head.find(' ', path_start) - path_start);
  std::vector<std::string> parts = split(path, '/');  // "", "ferry-fault", action, status, code
  const std::string action = parts.size() > 2 ? parts[2] : "";
  if (action == "reset") {
    linger l{1, 0};  // close with RST
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  } else if (action == "stall") {
    drain(fd, -1);
  } else if (action == "truncate") {
    if (method == "HEAD") {
      send_all(fd, "HTTP/1.1 200 OK\r\nContent-Len");  // cut inside the headers
    } else {
      // As long as the range asked for (so the client's buffer fits), half sent.
      uint64_t len = 2, a = 0, b = 0;
      const std::string range = header_value(head, "range");
      const auto dash = range.find('-');
      if (range.rfind("bytes=", 0) == 0 && dash != std::string::npos &&
          parse_u64(range.substr(6, dash - 6), &a) && parse_u64(range.substr(dash + 1), &b) &&
          b >= a)
        len = b - a + 1;
      len = std::min<uint64_t>(len, 1u << 20);
      send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(len) +
                       "\r\nETag: \"ferry-fault\"\r\nConnection: close\r\n\r\n" +
                       std::string(len / 2, 'x'));
    }
    ::shutdown(fd, SHUT_WR);
    drain(fd, 2000);
  } else {
    const std::string status = parts.size() > 3 ? parts[3] : "500";
    const std::string code = parts.size() > 4 ? parts[4] : "InternalError";
    const std::string body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>" + code +
                             "</Code><Message>injected by FERRY_FAULTS</Message></Error>";
    send_all(fd, "HTTP/1.1 " + status +
                     " Injected\r\nContent-Type: application/xml\r\nContent-Length: " +
                     std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" +
                     (method == "HEAD" ? "" : body));
    ::shutdown(fd, SHUT_WR);
    drain(fd, 2000);
  }
  ::close(fd);
}

// A listening socket on 127.0.0.1, one thread per connection; started on
// first use and kept for the life of the process (stalled connections end
// when their client gives up).
class FaultPeer {
 public:
  static Result<FaultPeer*> get() {
    static std::mutex mu;
    static FaultPeer* peer = nullptr;
    std::lock_guard<std::mutex> lock(mu);
    if (peer) return peer;
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Status::from_errno(errno, "socket", "the HTTP fault peer");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 64) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      Status st = Status::from_errno(errno, "listen", "the HTTP fault peer on 127.0.0.1");
      ::close(fd);
      return st;
    }
    peer = new FaultPeer(fd, ntohs(a.sin_port));  // never freed: threads may still answer
    std::thread([peer = peer] { peer->serve(); }).detach();
    return peer;
  }
  std::string url(const std::string& what) const {
    return "http://127.0.0.1:" + std::to_string(port_) + "/ferry-fault/" + what;
  }

 private:
  FaultPeer(int fd, int port) : fd_(fd), port_(port) {}
  void serve() {
    for (;;) {
      int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;
      }
      std::thread([c] { answer(c); }).detach();
    }
  }
  int fd_;
  int port_;
};

}  // namespace

std::string http_fault_op(const std::string& s3_op) {
  static const std::map<std::string, std::string> kMap = {{"PutObject", "put"},
                                                          {"GetObject", "get"},
                                                          {"HeadObject", "head"},
                                                          {"ListObjectsV2", "list"},
                                                          {"UploadPart", "part"},
                                                          {"CreateMultipartUpload", "create"},
                                                          {"CompleteMultipartUpload", "complete"},
                                                          {"AbortMultipartUpload", "abort"},
                                                          {"DeleteObjects", "delete"},
                                                          {"ListMultipartUploads", "uploads"},
                                                          {"CreateBucket", "bucket"}};
  auto it = kMap.find(s3_op);
  return it == kMap.end() ? s3_op : it->second;
}

std::string HttpFaultRule::to_string() const {
  std::string s = "http:";
  switch (action) {
    case Action::status:
      s += std::to_string(status);
      break;
    case Action::reset:
      s += "reset";
      break;
    case Action::truncate:
      s += "truncate";
      break;
    case Action::stall:
      s += "stall";
      break;
    case Action::latency:
      s += "latency";
      break;
  }
  s += ":" + op;
  if (action == Action::latency)
    s += ":" + std::to_string(latency.count()) + "us";
  else if (nth > 0)
    s += ":" + std::to_string(nth) + (sticky ? "+" : last > nth ? "-" + std::to_string(last) : "");
  else
    s += ":rate=" + std::to_string(rate_num) + "/" + std::to_string(rate_den) +
         ":seed=" + std::to_string(seed);
  if (action == Action::status) s += ":code=" + code;
  if (!key_contains.empty()) s += ":key=" + key_contains;
  return s;
}

Result<HttpFaultRule> parse_http_fault(const std::string& item) {
  std::vector<std::string> parts = split(item, ':');
  HttpFaultRule r;
  if (parts.size() < 3 || parts[0] != "http")
    return bad(item, "expected http:ACTION:OP[:TRIGGER] (e.g. http:503:part:1-2)");
  const std::string& action = parts[1];
  uint64_t status = 0;
  if (action == "reset") {
    r.action = HttpFaultRule::Action::reset;
  } else if (action == "truncate") {
    r.action = HttpFaultRule::Action::truncate;
  } else if (action == "stall") {
    r.action = HttpFaultRule::Action::stall;
  } else if (action == "latency") {
    r.action = HttpFaultRule::Action::latency;
  } else if (action.size() == 3 && parse_u64(action, &status) && status >= 300 && status <= 599) {
    r.action = HttpFaultRule::Action::status;
    r.status = static_cast<int>(status);
    r.code = status == 503 || status == 429 ? "SlowDown"
             : status == 500                ? "InternalError"
                                            : "Injected";
  } else {
    return bad(item, "unknown HTTP fault '" + action +
                         "' (expected a status 300-599, reset, truncate, stall or latency)");
  }
  r.op = parts[2];
  if (std::find(std::begin(kOps), std::end(kOps), r.op) == std::end(kOps))
    return bad(item, "unknown HTTP operation '" + r.op +
                         "' (expected put, get, head, list, part, create, complete, abort, "
                         "delete, uploads, bucket or any)");
  bool have_trigger = false, own_seed = false;
  for (size_t i = 3; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    const auto eq = p.find('=');
    if (eq != std::string::npos) {
      const std::string key = p.substr(0, eq), value = p.substr(eq + 1);
      if (key == "key") {
        if (value.empty()) return bad(item, "empty key filter");
        r.key_contains = value;
      } else if (key == "code" && r.action == HttpFaultRule::Action::status) {
        if (value.empty() || value.find('/') != std::string::npos)
          return bad(item, "bad code '" + value + "'");
        r.code = value;
      } else if (key == "seed" && r.action != HttpFaultRule::Action::latency) {
        if (!parse_u64(value, &r.seed)) return bad(item, "bad seed '" + value + "'");
        own_seed = true;
      } else if (key == "rate" && r.action != HttpFaultRule::Action::latency) {
        if (have_trigger) return bad(item, "more than one trigger ('" + p + "')");
        const auto slash = value.find('/');
        if (slash == std::string::npos || !parse_u64(value.substr(0, slash), &r.rate_num) ||
            !parse_u64(value.substr(slash + 1), &r.rate_den) || r.rate_den == 0 ||
            r.rate_num > r.rate_den)
          return bad(item, "bad rate '" + value + "' (expected A/B with 0 <= A <= B, B > 0)");
        have_trigger = true;
      } else {
        return bad(item, "unknown option '" + p + "'");
      }
      continue;
    }
    if (have_trigger) return bad(item, "more than one trigger ('" + p + "')");
    have_trigger = true;
    if (r.action == HttpFaultRule::Action::latency) {
      if (!drills::parse_duration(p, &r.latency))
        return bad(item, "bad duration '" + p + "' (expected e.g. 250us, 5ms, 1s)");
      continue;
    }
    std::string count = p;
    const auto dash = count.find('-');
    if (!count.empty() && count.back() == '+') {
      r.sticky = true;
      count.pop_back();
    } else if (dash != std::string::npos) {
      if (!parse_u64(count.substr(dash + 1), &r.last))
        return bad(item, "bad trigger '" + p + "' (expected N, N+, N-M or rate=A/B)");
      count.resize(dash);
    }
    if (!parse_u64(count, &r.nth) || r.nth == 0 || (dash != std::string::npos && r.last < r.nth))
      return bad(item,
                 "bad trigger '" + p + "' (expected N >= 1, N+, N-M with M >= N or rate=A/B)");
  }
  if (!have_trigger)
    return bad(item, r.action == HttpFaultRule::Action::latency
                         ? "missing the duration (e.g. http:latency:get:5ms)"
                         : "missing the trigger (N, N+, N-M or rate=A/B)");
  if (own_seed && r.nth > 0) return bad(item, "seed= only goes with rate=");
  return r;
}

HttpFaults::HttpFaults(std::vector<HttpFaultRule> rules) {
  for (HttpFaultRule& r : rules) rules_.push_back({std::move(r), 0, 0});
  for (RuleState& rs : rules_) rs.rng = rs.rule.seed;
}

std::string HttpFaults::before(const s3::AttemptInfo& a) {
  const std::string op = http_fault_op(a.op);
  std::chrono::microseconds delay{0};
  std::string what;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool counted = false;
    for (auto& [name, n] : attempts_)
      if (name == op) {
        ++n;
        counted = true;
      }
    if (!counted) attempts_.push_back({op, 1});
    for (RuleState& rs : rules_) {
      const HttpFaultRule& r = rs.rule;
      if ((r.op != "any" && r.op != op) || !key_matches(r.key_contains, a.key)) continue;
      if (r.action == HttpFaultRule::Action::latency) {
        delay += r.latency;
        continue;
      }
      ++rs.seen;
      bool fire;
      if (r.nth > 0)
        fire = r.sticky ? rs.seen >= r.nth : rs.seen >= r.nth && rs.seen <= std::max(r.nth, r.last);
      else
        fire = r.rate_den > 0 && splitmix64(rs.rng) % r.rate_den < r.rate_num;
      if (!fire || !what.empty()) continue;
      switch (r.action) {
        case HttpFaultRule::Action::status:
          what = "status/" + std::to_string(r.status) + "/" + r.code;
          break;
        case HttpFaultRule::Action::reset:
          what = "reset";
          break;
        case HttpFaultRule::Action::truncate:
          what = "truncate";
          break;
        default:
          what = "stall";
          break;
      }
    }
    if (!what.empty()) ++injected_;
    if (delay.count() > 0) ++delayed_;
  }
  if (delay.count() > 0)
    std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
        delay, std::chrono::milliseconds(std::max<int64_t>(0, a.bound_ms))));
  if (what.empty()) return "";
  Result<FaultPeer*> peer = FaultPeer::get();
  // Without a peer the attempt still fails, as a refused connection.
  return peer.ok() ? peer.value()->url(what) : "http://127.0.0.1:1/";
}

uint64_t HttpFaults::attempts(const std::string& op) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, n] : attempts_)
    if (name == op) return n;
  return 0;
}

uint64_t HttpFaults::injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return injected_;
}

uint64_t HttpFaults::delayed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return delayed_;
}

Result<std::shared_ptr<HttpFaults>> http_faults_from_rules(std::vector<HttpFaultRule> rules) {
  if (rules.empty()) return std::shared_ptr<HttpFaults>();
  return std::make_shared<HttpFaults>(std::move(rules));
}

Result<std::shared_ptr<HttpFaults>> http_faults_from_env(const char* var) {
  const char* spec = std::getenv(var);
  if (spec == nullptr || *spec == '\0') return std::shared_ptr<HttpFaults>();
  static std::mutex mu;
  static std::string last_spec;
  static std::shared_ptr<HttpFaults> last;
  std::lock_guard<std::mutex> lock(mu);
  if (last && last_spec == spec) return last;
  Result<FaultOptions> parsed = parse_fault_spec(spec);
  if (!parsed.ok()) return parsed.status().with_context(std::string(var) + ": ");
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<HttpFaults> made,
                         http_faults_from_rules(std::move(parsed->http_rules)));
  last_spec = spec;
  last = made;
  return made;
}

}  // namespace ferry
