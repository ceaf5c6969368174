// `ferry launch` as a user runs it: real processes, output through a pipe.

#include <catch2/catch.hpp>

#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "process.hpp"
#include "test_util.hpp"

namespace {

struct Run {
  int code = -1;  // the launcher's exit code, 128 + signal when it was killed
  std::vector<std::string> lines;
  double seconds = 0;
};

// Runs `ferry launch ARGS` through the shell, stderr merged into stdout.
Run launch(const std::string& args) {
  const ferry::testing::RunResult r =
      ferry::testing::run_shell(std::string(FERRY_CLI_PATH) + " launch " + args);
  return Run{r.code, ferry::testing::lines_of(r.out), r.seconds};
}

bool has(const Run& r, const std::string& line) {
  for (const auto& l : r.lines)
    if (l == line) return true;
  return false;
}

std::string dump(const Run& r) {
  std::string s = "exit " + std::to_string(r.code) + ", output:\n";
  for (const auto& l : r.lines) s += "  " + l + "\n";
  return s;
}

}  // namespace

TEST_CASE("launch starts N ranks with the torchrun environment", "[launch]") {
  const Run r =
      launch("-n 3 -- sh -c 'echo rank=$RANK world=$WORLD_SIZE token=${FERRY_JOB_TOKEN:+set}'");
  INFO(dump(r));
  CHECK(r.code == 0);
  for (int i = 0; i < 3; ++i) {
    const std::string want =
        "[rank " + std::to_string(i) + "] rank=" + std::to_string(i) + " world=3 token=set";
    CHECK(has(r, want));
  }
  CHECK(r.lines.size() == 3);
}

TEST_CASE("launch gives every rank the same MASTER_PORT and address", "[launch]") {
  const Run r = launch(
      "-n 3 -- sh -c 'echo port=$MASTER_PORT addr=$MASTER_ADDR "
      "local=$LOCAL_RANK/$LOCAL_WORLD_SIZE'");
  INFO(dump(r));
  REQUIRE(r.code == 0);
  REQUIRE(r.lines.size() == 3);
  std::set<std::string> ports;
  std::set<std::string> locals;
  for (const auto& l : r.lines) {
    const auto p = l.find("port=");
    REQUIRE(p != std::string::npos);
    const std::string port = l.substr(p + 5, l.find(' ', p) - (p + 5));
    CHECK(!port.empty());
    CHECK(std::stoi(port) > 0);
    CHECK(std::stoi(port) < 65536);
    ports.insert(port);
    CHECK(l.find("addr=127.0.0.1") != std::string::npos);
    locals.insert(l.substr(l.find("local=")));
  }
  CHECK(ports.size() == 1);
  CHECK(locals == std::set<std::string>{"local=0/3", "local=1/3", "local=2/3"});

  SECTION("--port wins, and a preset MASTER_PORT is kept") {
    const Run a = launch("-n 2 --port 29511 -- sh -c 'echo port=$MASTER_PORT'");
    INFO(dump(a));
    CHECK(a.code == 0);
    CHECK(has(a, "[rank 0] port=29511"));
    CHECK(has(a, "[rank 1] port=29511"));
    const ferry::testing::RunResult preset =
        ferry::testing::run({FERRY_CLI_PATH, "launch", "-n", "2", "--", "sh", "-c",
                             "echo $MASTER_PORT $FERRY_JOB_TOKEN"},
                            {"MASTER_PORT=29512", "FERRY_JOB_TOKEN=abc"});
    const std::string& out = preset.out;
    INFO(out);
    CHECK(preset.code == 0);
    CHECK(out.find("[rank 0] 29512 abc\n") != std::string::npos);
    CHECK(out.find("[rank 1] 29512 abc\n") != std::string::npos);
  }
}

// Ranks meet on MASTER_PORT + 1. A free port picked and let go before the
// ranks start can be taken by any other process's connect or listener in
// between (rank 0 then fails with "Address already in use"): the launcher
// holds it for the job, so that a plain bind fails while a listener that
// sets SO_REUSEADDR, as rank 0's does, binds, listens and is reached.
TEST_CASE("launch holds MASTER_PORT + 1 for the job's rank 0 alone", "[launch]") {
  ferry::testing::TempDir dir;
  const std::string script = dir.sub("probe.py");
  std::ofstream(script) << R"(import os, socket
port = int(os.environ["MASTER_PORT"]) + 1
plain = socket.socket()
try:
    plain.bind(("127.0.0.1", port))
    print("plain bind: taken")
except OSError:
    print("plain bind: refused")
lis = socket.socket()
lis.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lis.bind(("127.0.0.1", port))
lis.listen(1)
conn = socket.create_connection(("127.0.0.1", port))
lis.accept()
print("rank 0 listener: reached")
)";
  const Run r = launch("-n 1 -- python3 " + script);
  INFO(dump(r));
  CHECK(r.code == 0);
  CHECK(has(r, "[rank 0] plain bind: refused"));
  CHECK(has(r, "[rank 0] rank 0 listener: reached"));
}

TEST_CASE("launch forwards stderr and a last line without newline", "[launch]") {
  const Run r = launch("-n 2 -- sh -c 'echo out-$RANK; echo err-$RANK >&2; printf tail-$RANK'");
  INFO(dump(r));
  CHECK(r.code == 0);
  for (const char* rank : {"0", "1"}) {
    const std::string p = std::string("[rank ") + rank + "] ";
    CHECK(has(r, p + "out-" + rank));
    CHECK(has(r, p + "err-" + rank));
    CHECK(has(r, p + "tail-" + rank));
  }
}

TEST_CASE("a failing rank makes launch fail, name it and stop the others", "[launch]") {
  SECTION("the others finish on their own") {
    const Run r = launch("-n 3 -- sh -c 'if [ \"$RANK\" = 2 ]; then exit 3; fi'");
    INFO(dump(r));
    CHECK(r.code != 0);
    CHECK(has(r, "[launch] rank 2 exited with status 3"));
  }
  SECTION("the others hang: SIGTERM after the grace period") {
    const Run r = launch(
        "-n 3 --grace 0.5 -- sh -c 'if [ \"$RANK\" = 1 ]; then exit 3; fi; "
        "exec sleep 60'");
    INFO(dump(r));
    CHECK(r.code != 0);
    CHECK(has(r, "[launch] rank 1 exited with status 3"));
    CHECK(has(r, "[launch] rank 0 killed by signal 15 (Terminated)"));
    CHECK(has(r, "[launch] rank 2 killed by signal 15 (Terminated)"));
    CHECK(r.seconds < 30);
  }
  SECTION("a rank that ignores SIGTERM is killed") {
    const Run r = launch(
        "-n 2 --grace 0.3 -- sh -c 'if [ \"$RANK\" = 0 ]; then exit 1; fi; "
        "trap \"\" TERM; while :; do sleep 0.1; done'");
    INFO(dump(r));
    CHECK(r.code != 0);
    CHECK(has(r, "[launch] rank 0 exited with status 1"));
    CHECK(has(r, "[launch] rank 1 killed by signal 9 (Killed)"));
    CHECK(r.seconds < 30);
  }
  SECTION("a command that does not exist") {
    const Run r = launch("-n 2 -- /nonexistent/ferry-launch-test");
    INFO(dump(r));
    CHECK(r.code == 127);
    CHECK(has(r, "[launch] rank 0 exited with status 127"));
  }
}

TEST_CASE("SIGTERM to the launcher reaches every rank", "[launch]") {
  ferry::testing::TempDir dir;
  const std::string script = dir.sub("rank.sh");
  {
    std::ofstream f(script);
    f << "trap 'echo term-$RANK; exit 0' TERM\n"
         "echo ready-$RANK\n"
         "while :; do sleep 0.05; done\n";
  }
  // The outer shell waits until both ranks are up, then signals the launcher
  // (not its process group: the ranks must get the signal from it).
  const std::string ready = dir.sub("ready");
  const std::string cmd = std::string("sh -c '") + FERRY_CLI_PATH +
                          " launch -n 2 --grace 5 -- sh " + script + " > " + ready +
                          " 2>&1 & pid=$!; " + "for i in $(seq 200); do " + "[ $(grep -c ready- " +
                          ready + ") = 2 ] && break; sleep 0.05; done; " +
                          "kill -TERM $pid; wait $pid; echo rc=$?; cat " + ready + "'";
  const std::string out = ferry::testing::run_shell(cmd).out;
  INFO(out);
  CHECK(out.find("rc=0\n") != std::string::npos);
  CHECK(out.find("[rank 0] term-0\n") != std::string::npos);
  CHECK(out.find("[rank 1] term-1\n") != std::string::npos);
}

TEST_CASE("launch refuses bad flags", "[launch]") {
  CHECK(launch("-- true").code == 2);
  CHECK(launch("-n 0 -- true").code == 2);
  CHECK(launch("-n 2 --port 70000 -- true").code == 2);
  CHECK(launch("-n 2 --grace x -- true").code == 2);
  CHECK(launch("-n 2").code == 2);
}
