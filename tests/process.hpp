// Running other programs from a test: the one place that forks and execs.
// `run` and `run_shell` run a command to its end and return what it printed,
// its exit code and how long it took; `Process` is a child that runs beside
// the test (a peer rank), with an optional line-based pipe to its stdin and
// from its stdout.
//
// Children get PR_SET_PDEATHSIG(SIGKILL), so none outlives a crashed test.
// The environment is assembled before fork: between fork and exec only
// async-signal-safe calls are allowed (tests run CAF and UCX threads).
#pragma once

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grp.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace ferry::testing {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct ProcessOptions {
  std::vector<std::string> env;  // NAME=value, added to (or replacing in) the test's own
  bool capture_stdout = false;   // read the child's stdout (else it shares the test's)
  bool merge_stderr = false;     // with capture_stdout: stderr goes to the same pipe
  bool pipe_stdin = false;       // lines can be sent with say(); else stdin is the test's
};

// A child process. SIGKILLed and reaped on destruction if still running.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const ProcessOptions& o) {
    REQUIRE(!argv.empty());
    std::vector<std::string> args = argv;
    std::vector<char*> cargv;
    for (auto& a : args) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    std::vector<std::string> env = merged_env(o.env);
    std::vector<char*> cenv;
    for (auto& e : env) cenv.push_back(e.data());
    cenv.push_back(nullptr);

    int to_child[2] = {-1, -1};
    int from_child[2] = {-1, -1};
    if (o.pipe_stdin) REQUIRE(pipe2(to_child, O_CLOEXEC) == 0);
    if (o.capture_stdout) REQUIRE(pipe2(from_child, O_CLOEXEC) == 0);
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (o.pipe_stdin) dup2(to_child[0], 0);
      if (o.capture_stdout) {
        dup2(from_child[1], 1);
        if (o.merge_stderr) dup2(from_child[1], 2);
      }
      execvpe(cargv[0], cargv.data(), cenv.data());
      _exit(127);  // as a shell reports a command it cannot run
    }
    if (o.pipe_stdin) {
      close(to_child[0]);
      stdin_ = to_child[1];
    }
    if (o.capture_stdout) {
      close(from_child[1]);
      stdout_ = from_child[0];
    }
  }
  ~Process() {
    if (pid_ > 0 && !exit_code_) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    if (stdin_ >= 0) close(stdin_);
    if (stdout_ >= 0) close(stdout_);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) { kill(pid_, sig); }
  bool alive() { return !wait_exit(0).has_value(); }

  // REQUIRES: pipe_stdin.
  void say(const std::string& line) {
    std::string l = line + "\n";
    REQUIRE(write(stdin_, l.data(), l.size()) == static_cast<ssize_t>(l.size()));
  }

  // The next line the process printed, or nullopt at its end or after
  // timeout_s. REQUIRES: capture_stdout.
  std::optional<std::string> read_line(double timeout_s) {
    const auto start = Clock::now();
    for (;;) {
      size_t nl = out_.find('\n');
      if (nl != std::string::npos) {
        std::string line = out_.substr(0, nl);
        out_.erase(0, nl + 1);
        return line;
      }
      if (!read_some(timeout_s - seconds_since(start))) return std::nullopt;
    }
  }

  // Everything the process prints until it closes its stdout, or until
  // timeout_s (0: no limit). False on timeout. REQUIRES: capture_stdout.
  bool read_all(std::string* out, double timeout_s) {
    const auto start = Clock::now();
    while (true) {
      const double left = timeout_s > 0 ? timeout_s - seconds_since(start) : 3600.0;
      if (left <= 0) break;
      if (!read_some(left)) {
        if (eof_) break;
        continue;
      }
    }
    out->append(out_);
    out_.clear();
    return eof_;
  }

  // The exit code (128 + signal if killed), or nullopt if still running
  // after timeout_s.
  std::optional<int> wait_exit(double timeout_s) {
    const auto start = Clock::now();
    while (!exit_code_) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (seconds_since(start) >= timeout_s) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return exit_code_;
  }

 private:
  static std::vector<std::string> merged_env(const std::vector<std::string>& extra) {
    std::vector<std::string> env;
    auto name_of = [](const std::string& e) { return e.substr(0, e.find('=')); };
    for (char** e = environ; *e; ++e) {
      std::string entry = *e;
      bool replaced = false;
      for (const auto& x : extra) replaced = replaced || name_of(x) == name_of(entry);
      if (!replaced) env.push_back(std::move(entry));
    }
    env.insert(env.end(), extra.begin(), extra.end());
    return env;
  }

  // Appends what arrives within timeout_s; false on timeout or at the end.
  bool read_some(double timeout_s) {
    if (eof_ || timeout_s <= 0) return false;
    pollfd p{stdout_, POLLIN, 0};
    int ready = poll(&p, 1, static_cast<int>(timeout_s * 1000) + 1);
    if (ready < 0 && errno == EINTR) return true;
    if (ready <= 0) return false;
    char buf[4096];
    ssize_t n = read(stdout_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) return true;
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    out_.append(buf, static_cast<size_t>(n));
    return true;
  }

  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  int stdin_ = -1;
  int stdout_ = -1;
  bool eof_ = false;
  std::string out_;
};

struct RunResult {
  int code = -1;    // exit code, 128 + signal if killed (also on timeout)
  std::string out;  // stdout and stderr together
  double seconds = 0;
  bool timed_out = false;
};

// Runs argv (found on PATH) to its end. With timeout_s > 0 a child still
// running then is SIGKILLed and timed_out set.
inline RunResult run(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                     double timeout_s = 0) {
  const auto t0 = Clock::now();
  ProcessOptions o;
  o.env = env;
  o.capture_stdout = true;
  o.merge_stderr = true;
  Process p(argv, o);
  RunResult r;
  r.timed_out = !p.read_all(&r.out, timeout_s);
  if (r.timed_out) p.signal(SIGKILL);
  r.code = p.wait_exit(3600).value_or(-1);
  r.seconds = seconds_since(t0);
  return r;
}

// Runs a shell command line (sh -c), for tests that need redirections,
// pipes or the shell's own job control.
inline RunResult run_shell(const std::string& cmd, const std::vector<std::string>& env = {},
                           double timeout_s = 0) {
  return run({"/bin/sh", "-c", cmd}, env, timeout_s);
}

// `out` split at its newlines; a last line without one is still a line.
inline std::vector<std::string> lines_of(const std::string& out) {
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin < out.size()) {
    size_t end = out.find('\n', begin);
    if (end == std::string::npos) end = out.size();
    lines.push_back(out.substr(begin, end - begin));
    begin = end + 1;
  }
  return lines;
}

// Runs `body` in a forked child as the unprivileged user nobody (65534), for
// checks that root would pass by bypassing permissions; the files it touches
// must be reachable by that user. Returns body's result, or nullopt when
// privileges cannot be dropped here. Runs it in this process when the test is
// not root. REQUIRES: body uses no Catch2 macros (it runs in a child).
inline std::optional<int> run_unprivileged(const std::function<int()>& body) {
  if (::geteuid() != 0) return body();
  constexpr int kCannotDrop = 125;
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    constexpr uid_t kNobody = 65534;
    if (setgroups(0, nullptr) != 0 || setresgid(kNobody, kNobody, kNobody) != 0 ||
        setresuid(kNobody, kNobody, kNobody) != 0)
      _exit(kCannotDrop);
    _exit(body());
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) == kCannotDrop) return std::nullopt;
  return WEXITSTATUS(status);
}

}  // namespace ferry::testing
