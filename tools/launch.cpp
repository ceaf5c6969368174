// ferry launch: starts N local ranks of a command, torchrun style, and
// forwards their output with a "[rank N] " prefix.
//
// Each rank is forked and exec'd at once: everything it needs (argv, its
// environment) is built in the parent before the fork, because a process
// that has initialised CUDA must not do real work in a forked child. Each
// rank runs in its own process group, so a terminal's Ctrl-C reaches the
// launcher only and is forwarded once, and a teardown also reaches whatever
// the rank started (a shell's children).
//
//   running --(a rank fails)--> grace --(grace s)--> SIGTERM --(grace s)--> SIGKILL
//      |                                               ^
//      +--(SIGINT/SIGTERM to the launcher: forwarded)--+
//
// The exit code is 0 only if every rank exited 0.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tools/commands.hpp"

extern char** environ;

namespace ferry::cli {

namespace {

using Clock = std::chrono::steady_clock;

// A line longer than this without a newline is forwarded in pieces, so a
// rank that never writes one cannot grow the launcher's memory.
constexpr size_t kMaxLine = 64 * 1024;
// After the last rank exits, output still in flight (or held by a leftover
// grandchild that keeps the pipe open) is read for at most this long.
constexpr auto kDrainAfterExit = std::chrono::seconds(2);

// --- signals: a self-pipe, so poll() wakes for them ---------------------------

int g_signal_pipe_w = -1;

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  // A full pipe already holds a wake-up; losing this byte is harmless for
  // SIGCHLD, and INT/TERM are rarely sent 64 Ki times.
  (void)!::write(g_signal_pipe_w, &b, 1);
  errno = saved;
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

void say(const std::string& msg) {
  const std::string line = "[launch] " + msg + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

// --- setup helpers -----------------------------------------------------------

// A socket bound to `port` on every IPv4 address (rank 0 may listen on
// MASTER_ADDR, not loopback) with SO_REUSEADDR and never listening, or -1.
// While it is open, no bind(0) and no outgoing connect of any process is
// given the port, and a bind without SO_REUSEADDR fails; rank 0's listener,
// which sets SO_REUSEADDR, still binds and listens there.
int reserve_port(int port) {
  const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  const int one = 1;
  ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

struct PickedPort {
  int port;
  int reservation;  // holds port + 1 until the launcher exits
};

// A free MASTER_PORT whose successor is free too: Ferry's ranks meet on
// MASTER_PORT + 1 while torch-style code may use MASTER_PORT itself. The
// successor stays reserved for the job: checked and let go, it was taken
// by another process's connect or listener often enough, under parallel
// jobs, that rank 0 failed with "Address already in use" (CI, once).
std::optional<PickedPort> free_port() {
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return std::nullopt;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int port = -1;
    if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
    ::close(s);
    if (port <= 0 || port >= 65535) continue;
    if (const int held = reserve_port(port + 1); held >= 0) return PickedPort{port, held};
  }
  return std::nullopt;
}

std::optional<std::string> random_token() {
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  unsigned char b[16];
  size_t got = 0;
  while (got < sizeof(b)) {
    const ssize_t n = ::read(fd, b + got, sizeof(b) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got != sizeof(b)) return std::nullopt;
  std::string hex;
  for (unsigned char c : b) {
    static const char* digits = "0123456789abcdef";
    hex += digits[c >> 4];
    hex += digits[c & 15];
  }
  return hex;
}

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// --- ranks -------------------------------------------------------------------

// One of a rank's output pipes and the part of a line not yet forwarded.
struct Stream {
  int fd = -1;
  int to = STDOUT_FILENO;  // where its lines go
  std::string partial;
};

struct Rank {
  int index = 0;
  pid_t pid = -1;
  Stream out, err;
  bool reaped = false;
  int status = 0;  // waitpid's
};

std::string prefix(int rank) {
  return "[rank " + std::to_string(rank) + "] ";
}

// Forwards the complete lines of `s` (all of it at EOF) in one write, so
// lines of different ranks interleave whole.
void emit(Stream& s, int rank, bool eof) {
  std::string text;
  size_t start = 0;
  for (;;) {
    size_t nl = s.partial.find('\n', start);
    if (nl == std::string::npos) {
      if (!eof && s.partial.size() - start < kMaxLine) break;
      if (start == s.partial.size()) break;
      nl = s.partial.size();  // forwarded as a line of its own
    }
    text += prefix(rank);
    text.append(s.partial, start, nl - start);
    text += '\n';
    start = std::min(nl + 1, s.partial.size());
  }
  s.partial.erase(0, start);
  if (!text.empty()) write_all(s.to, text.data(), text.size());
}

// Reads what is available now (the fds are non-blocking); closes at EOF.
void pump(Stream& s, int rank) {
  char buf[65536];
  while (s.fd >= 0) {
    const ssize_t n = ::read(s.fd, buf, sizeof(buf));
    if (n > 0) {
      s.partial.append(buf, static_cast<size_t>(n));
      emit(s, rank, false);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    ::close(s.fd);  // EOF, or an error that ends this stream just the same
    s.fd = -1;
    emit(s, rank, true);
  }
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

bool failed(int status) {
  return !WIFEXITED(status) || WEXITSTATUS(status) != 0;
}

int exit_code_of(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

struct Spawned {
  std::vector<Rank> ranks;
  std::string error;  // set when not every rank could be started
};

// Forks and execs every rank. argv and each rank's envp are complete before
// the first fork; the child only wires up its descriptors and execs.
Spawned spawn_ranks(const std::vector<std::string>& cmd,
                    const std::vector<std::vector<std::string>>& envs, const sigset_t& child_mask) {
  Spawned sp;
  std::vector<char*> argv;
  for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::vector<char*>> envps(envs.size());
  for (size_t r = 0; r < envs.size(); ++r) {
    for (const auto& e : envs[r]) envps[r].push_back(const_cast<char*>(e.c_str()));
    envps[r].push_back(nullptr);
  }
  const std::string exec_error = "ferry launch: cannot run '" + cmd[0] + "': ";
  const pid_t launcher = ::getpid();
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) {
    sp.error = std::string("cannot open /dev/null: ") + std::strerror(errno);
    return sp;
  }

  for (size_t r = 0; r < envs.size(); ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) {
      sp.error = "rank " + std::to_string(r) + ": pipe: " + std::strerror(errno);
      break;
    }
    if (::pipe2(err, O_CLOEXEC) != 0) {
      sp.error = "rank " + std::to_string(r) + ": pipe: " + std::strerror(errno);
      ::close(out[0]);
      ::close(out[1]);
      break;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Own process group (see the top of the file); die with the launcher
      // so a SIGKILLed launcher leaves no orphaned ranks behind.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(127);
      ::dup2(devnull, STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      // The launcher's handlers would write to its self-pipe; exec resets
      // them anyway, this only closes the window before it.
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGCHLD, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &child_mask, nullptr);
      ::execvpe(argv[0], argv.data(), envps[r].data());
      const char* why = std::strerror(errno);
      write_all(STDERR_FILENO, exec_error.data(), exec_error.size());
      write_all(STDERR_FILENO, why, std::strlen(why));
      write_all(STDERR_FILENO, "\n", 1);
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    if (pid < 0) {
      sp.error = "rank " + std::to_string(r) + ": fork: " + std::strerror(errno);
      ::close(out[0]);
      ::close(err[0]);
      break;
    }
    // Also here: a signal sent to the group right after fork must not miss
    // a child that has not run its own setpgid yet.
    ::setpgid(pid, pid);
    Rank rank;
    rank.index = static_cast<int>(r);
    rank.pid = pid;
    rank.out = {out[0], STDOUT_FILENO, {}};
    rank.err = {err[0], STDERR_FILENO, {}};
    ::fcntl(out[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err[0], F_SETFL, O_NONBLOCK);
    sp.ranks.push_back(std::move(rank));
  }
  ::close(devnull);
  return sp;
}

// The signal goes to the rank's whole process group (what it started, too).
void signal_ranks(std::vector<Rank>& ranks, int sig) {
  for (auto& r : ranks)
    if (!r.reaped) ::kill(-r.pid, sig);
}

struct Flags {
  long nproc = 0;
  std::optional<long> port;
  double grace_s = 10;
  std::vector<std::string> cmd;
};

bool is_overridden(const std::string& entry, const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (entry.size() > n.size() && entry.compare(0, n.size(), n) == 0 && entry[n.size()] == '=')
      return true;
  return false;
}

int run_launch(const Flags& flags) {
  const int n = static_cast<int>(flags.nproc);

  // --- the environment every rank shares -------------------------------------
  std::string port;
  if (flags.port) {
    port = std::to_string(*flags.port);
  } else if (const char* p = env_or_null("MASTER_PORT")) {
    port = p;
  } else if (auto p = free_port()) {
    port = std::to_string(p->port);  // p->reservation closes when the launcher exits
  } else {
    std::fprintf(stderr, "ferry launch: no free port on 127.0.0.1: %s (use --port)\n",
                 std::strerror(errno));
    return 1;
  }
  std::string token;
  if (const char* t = env_or_null("FERRY_JOB_TOKEN")) {
    token = t;
  } else if (auto t = random_token()) {
    token = *t;
  } else {
    std::fprintf(stderr, "ferry launch: cannot read /dev/urandom for FERRY_JOB_TOKEN: %s\n",
                 std::strerror(errno));
    return 1;
  }
  const char* addr = env_or_null("MASTER_ADDR");
  const std::vector<std::string> ours = {
      "RANK",        "LOCAL_RANK",  "WORLD_SIZE",     "LOCAL_WORLD_SIZE",
      "MASTER_ADDR", "MASTER_PORT", "FERRY_JOB_TOKEN"};
  std::vector<std::string> base;
  for (char** e = environ; e && *e; ++e)
    if (!is_overridden(*e, ours)) base.emplace_back(*e);
  base.push_back("WORLD_SIZE=" + std::to_string(n));
  base.push_back("LOCAL_WORLD_SIZE=" + std::to_string(n));
  base.push_back(std::string("MASTER_ADDR=") + (addr ? addr : "127.0.0.1"));
  base.push_back("MASTER_PORT=" + port);
  base.push_back("FERRY_JOB_TOKEN=" + token);
  std::vector<std::vector<std::string>> envs(n, base);
  for (int r = 0; r < n; ++r) {
    envs[r].push_back("RANK=" + std::to_string(r));
    envs[r].push_back("LOCAL_RANK=" + std::to_string(r));
  }

  // --- signals -------------------------------------------------------------------
  int sig_pipe[2];
  if (::pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::fprintf(stderr, "ferry launch: pipe: %s\n", std::strerror(errno));
    return 1;
  }
  g_signal_pipe_w = sig_pipe[1];
  // Blocked while the ranks start, so no handler runs in a child between
  // fork and exec; each child restores the original mask before exec.
  sigset_t handled, original;
  sigemptyset(&handled);
  for (int s : {SIGINT, SIGTERM, SIGCHLD}) sigaddset(&handled, s);
  ::sigprocmask(SIG_BLOCK, &handled, &original);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  struct sigaction old_int {
  }, old_term{}, old_chld{};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  ::sigaction(SIGCHLD, &sa, &old_chld);

  Spawned sp = spawn_ranks(flags.cmd, envs, original);
  std::vector<Rank>& ranks = sp.ranks;
  ::sigprocmask(SIG_SETMASK, &original, nullptr);

  const auto grace =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(flags.grace_s));
  std::optional<Clock::time_point> term_at, kill_at, drain_until;
  bool stopping = false;  // a teardown is scheduled or under way
  int exit_code = 0;
  if (!sp.error.empty()) {
    say("could not start every rank: " + sp.error + "; stopping the " +
        std::to_string(ranks.size()) + " started");
    signal_ranks(ranks, SIGTERM);
    kill_at = Clock::now() + grace;
    stopping = true;
    exit_code = 1;
  }

  size_t live = ranks.size();
  for (;;) {
    // Reap first: a rank's exit is reported after the output it left in
    // its pipes, and starts the grace period of the others.
    for (auto& r : ranks) {
      if (r.reaped) continue;
      int status = 0;
      const pid_t p = ::waitpid(r.pid, &status, WNOHANG);
      if (p == 0 || (p < 0 && errno == EINTR)) continue;
      r.reaped = true;
      r.status = p == r.pid ? status : (127 << 8);
      --live;
      pump(r.out, r.index);
      pump(r.err, r.index);
      if (failed(r.status)) {
        say("rank " + std::to_string(r.index) + " " + describe(r.status));
        if (exit_code == 0) exit_code = exit_code_of(r.status);
        if (!stopping && live > 0) {
          stopping = true;
          term_at = Clock::now() + grace;
          char buf[128];
          std::snprintf(buf, sizeof(buf), "stopping the other %zu rank(s) in %.3g s", live,
                        flags.grace_s);
          say(buf);
        }
      }
    }
    const auto now = Clock::now();
    if (live == 0 && !drain_until) drain_until = now + kDrainAfterExit;
    if (term_at && now >= *term_at && live > 0) {
      say("sending SIGTERM to " + std::to_string(live) + " rank(s)");
      signal_ranks(ranks, SIGTERM);
      term_at.reset();
      kill_at = now + grace;
    }
    if (kill_at && now >= *kill_at && live > 0) {
      say("sending SIGKILL to " + std::to_string(live) + " rank(s)");
      signal_ranks(ranks, SIGKILL);
      kill_at.reset();
    }

    std::vector<pollfd> fds{{sig_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Stream*, int>> streams{{nullptr, 0}};  // parallel to fds
    for (auto& r : ranks)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back({s, r.index});
        }
    if (live == 0 && (fds.size() == 1 || now >= *drain_until)) break;

    std::optional<Clock::time_point> wake;
    for (const auto& t : {term_at, kill_at, drain_until})
      if (t && (!wake || *t < *wake)) wake = t;
    int timeout_ms = -1;
    if (wake) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*wake - now).count();
      timeout_ms = static_cast<int>(std::max<long long>(0, std::min<long long>(left, 1 << 30)));
    }
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) {
      say(std::string("poll: ") + std::strerror(errno));
      signal_ranks(ranks, SIGKILL);
      exit_code = 1;
      break;
    }
    if (ready <= 0) continue;
    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t got;
      while ((got = ::read(sig_pipe[0], sigs, sizeof(sigs))) > 0) {
        for (ssize_t k = 0; k < got; ++k) {
          if (sigs[k] != SIGINT && sigs[k] != SIGTERM) continue;  // SIGCHLD: reaped above
          say(std::string("got ") + strsignal(sigs[k]) + ", forwarding it to " +
              std::to_string(live) + " rank(s)");
          signal_ranks(ranks, sigs[k]);
          stopping = true;
          term_at.reset();
          if (!kill_at) kill_at = Clock::now() + grace;
        }
      }
    }
    for (size_t k = 1; k < fds.size(); ++k)
      if (fds[k].revents) pump(*streams[k].first, streams[k].second);
  }

  // Whatever is left (a grandchild still holding a pipe) is cut off here.
  for (auto& r : ranks)
    for (Stream* s : {&r.out, &r.err}) {
      if (s->fd >= 0) ::close(s->fd);
      s->fd = -1;
      emit(*s, r.index, true);
    }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGCHLD, &old_chld, nullptr);
  ::close(sig_pipe[0]);
  ::close(sig_pipe[1]);
  g_signal_pipe_w = -1;
  // A forwarded signal after which every rank exited 0 is still a success:
  // the ranks decided how to end.
  return exit_code;
}

}  // namespace

void add_launch_command(CLI::App& app, int* rc) {
  struct Values {
    Flags flags;
    long port = 0;
  };
  auto v = std::make_shared<Values>();
  CLI::App* cmd =
      app.add_subcommand("launch", "start N ranks of CMD here with the torchrun environment");
  cmd->add_option("-n,--nproc", v->flags.nproc, "ranks to start on this machine")
      ->required()
      ->check(CLI::Range(1L, 4096L).description(""))
      ->type_name("N");
  CLI::Option* port =
      cmd->add_option("--port", v->port, "MASTER_PORT (default: $MASTER_PORT, else a free port)")
          ->check(CLI::Range(1L, 65535L).description(""))
          ->type_name("P");
  cmd->add_option("--grace", v->flags.grace_s,
                  "seconds the other ranks get after one fails, before SIGTERM, and again "
                  "before SIGKILL (default 10)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            char* end = nullptr;
            const double s = std::strtod(text.c_str(), &end);
            if (text.empty() || *end != '\0' || !std::isfinite(s) || s < 0 || s > 86400)
              return "'" + text + "' is not a number of seconds in 0..86400";
            return {};
          },
          ""))
      ->type_name("S");
  // Everything from the first argument that is no flag of ours (or after
  // --) is the command, its own flags included.
  cmd->add_option("CMD", v->flags.cmd, "the command each rank runs, and its arguments")
      ->required()
      ->type_name("");
  cmd->positionals_at_end();
  cmd->footer(
      "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR\n"
      "(127.0.0.1 unless set), MASTER_PORT and FERRY_JOB_TOKEN (random unless set).\n"
      "A command that starts with - goes after --. The exit code is 0 only if every rank\n"
      "exited 0.");
  cmd->callback([rc, v, port] {
    if (port->count() > 0) v->flags.port = v->port;
    *rc = run_launch(v->flags);
  });
}

}  // namespace ferry::cli
