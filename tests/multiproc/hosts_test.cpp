// Many hosts on this machine (tests/hosts/hosts.sh): each host its own
// network, UTS, IPC, PID and mount namespaces with a veth into a bridge, and
// the checkpoint root a directory all of them see. Ranks on different hosts
// meet over the veths only (no shared memory between hosts), so node
// identity, read-once-per-node and the failure of a whole host are tested as
// they happen across machines. Needs root and iproute2: skipped (naming why)
// where the tool cannot run, failed instead under FERRY_REQUIRE_HOSTS=1.

#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "catalog.hpp"
#include "manifest.hpp"
#include "multiproc/hostile.hpp"
#include "multiproc/launch.hpp"
#include "multiproc/load_stats.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::count;
using ferry::testing::data_bytes;
using ferry::testing::lines_with;
using ferry::testing::LoadStats;
using ferry::testing::run_shell;
using ferry::testing::RunResult;
using ferry::testing::TempDir;

namespace {

const std::string kTool = FERRY_HOSTS_TOOL;
// The worker's model plus a 2 MiB replicated tensor; its heartbeat timeout is 3 s.
const std::string kModel = " --big-mib 2";

// Why the emulated hosts cannot run here, or "" when they can.
std::string hosts_unavailable() {
  const RunResult r = run_shell(kTool + " check");
  if (r.code == 0) return "";
  return r.out.empty() ? "hosts.sh check exited " + std::to_string(r.code) : r.out;
}

bool hosts_required() {
  const char* v = std::getenv("FERRY_REQUIRE_HOSTS");
  return v != nullptr && std::string(v) == "1";
}

#define FERRY_NEED_HOSTS()                                                 \
  do {                                                                     \
    const std::string why_ = hosts_unavailable();                          \
    if (!why_.empty()) {                                                   \
      if (hosts_required()) FAIL("FERRY_REQUIRE_HOSTS=1 but " << why_);    \
      FERRY_SKIP(why_ << " (FERRY_REQUIRE_HOSTS=1 makes this a failure)"); \
    }                                                                      \
  } while (false)

// A set of emulated hosts, torn down when the test ends (and by the next
// `up` if this process dies first: the set is owned by it).
class Hosts {
 public:
  Hosts(int n, const std::string& shared) : name_("t" + std::to_string(::getpid())), n_(n) {
    const RunResult r = run_shell(kTool + " up " + name_ + " " + std::to_string(n) + " --shared " +
                                  shared + " --owner " + std::to_string(::getpid()));
    INFO(r.out);
    REQUIRE(r.code == 0);
  }
  ~Hosts() { (void)run_shell(kTool + " down " + name_); }
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  const std::string& name() const { return name_; }

  // The shell command of a job: `per_host` ranks of the worker on each of
  // `hosts` (comma-separated indices; "" = all), rank 0 on the first.
  std::string job_cmd(int per_host, const std::string& hosts, const std::string& args,
                      const std::string& env = "") const {
    return env + " " + kTool + " job " + name_ + " -n " + std::to_string(per_host) +
           (hosts.empty() ? "" : " --hosts " + hosts) + " -- " + FERRY_RANK_WORKER_PATH + " " +
           args;
  }
  RunResult job(int per_host, const std::string& hosts, const std::string& args,
                const std::string& env = "") const {
    return run_shell(job_cmd(per_host, hosts, args, env), {}, 120);
  }
  void tool(const std::string& what) const {
    const RunResult r = run_shell(kTool + " " + what);
    INFO(kTool << " " << what << ": " << r.out);
    REQUIRE(r.code == 0);
  }
  // Bytes host `i` has sent plus received on its link so far.
  uint64_t link_bytes(int i) const {
    const RunResult r = run_shell(kTool + " bytes " + name_ + " " + std::to_string(i));
    REQUIRE(r.code == 0);
    const auto field = [&](const std::string& f) {
      return std::stoull(r.out.substr(r.out.find(f + "=") + f.size() + 1));
    };
    return field("sent") + field("received");
  }

 private:
  std::string name_;
  int n_;
};

std::string latest_path(const std::string& root) {
  auto latest = ferry::find_latest(*ferry::posix_filesystem(), root);
  REQUIRE(latest.ok());
  return latest->path;
}

// Each rank's RINGPEERS line: its node's host name and the ranks whose rings
// it may use.
std::map<int, std::pair<std::string, std::set<int>>> ring_peers(const std::string& out, int ranks) {
  std::map<int, std::pair<std::string, std::set<int>>> peers;
  for (int r = 0; r < ranks; ++r) {
    const auto lines = lines_with(out, "[rank " + std::to_string(r) + "] RINGPEERS");
    if (lines.size() != 1) continue;
    const std::string& l = lines[0];
    const auto node_at = l.find("node=") + 5;
    // "<boot id>:<host name>": emulated hosts share the boot, so the name tells.
    std::string node = l.substr(node_at, l.find(' ', node_at) - node_at);
    node = node.substr(node.find(':') + 1);
    std::set<int> ps;
    std::string list = l.substr(l.find("peers=") + 6);
    for (size_t at = 0; at < list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      ps.insert(std::stoi(list.substr(at, comma - at)));
      at = comma + 1;
    }
    peers[r] = {node, ps};
  }
  return peers;
}

// The pids (in this namespace) of the rank workers whose command line holds `needle`.
std::vector<pid_t> workers_with(const std::string& needle) {
  std::vector<pid_t> pids;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream cmd(e.path() / "cmdline");
    std::string args;
    try {
      args.assign(std::istreambuf_iterator<char>(cmd), {});
    } catch (const std::ios_base::failure&) {
      continue;  // it exited while we read (ESRCH): any process on the machine may
    }
    std::replace(args.begin(), args.end(), '\0', ' ');
    if (args.rfind(FERRY_RANK_WORKER_PATH, 0) == 0 && args.find(needle) != std::string::npos)
      pids.push_back(std::stoi(pid));
  }
  return pids;
}

// The pid of a stopped rank worker whose command line holds `needle`, or 0.
pid_t stopped_with(const std::string& needle) {
  for (pid_t pid : workers_with(needle)) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close != std::string::npos && line.size() >= close + 3 && line[close + 2] == 'T')
      return pid;
  }
  return 0;
}

pid_t parent_of(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  char state = 0;
  pid_t ppid = 0;
  rest >> state >> ppid;
  return ppid;
}

// Starts a 2 hosts x 2 ranks job of the worker with `args` in which rank
// `rank` stops itself at kill point `point`; its pid once it has stopped
// (found by `root`, which its command line holds).
pid_t start_stopped(const Hosts& h, const std::string& root, const std::string& args,
                    const std::string& point, std::unique_ptr<ferry::testing::Process>* job,
                    int rank = 2) {
  ferry::testing::ProcessOptions o;
  o.capture_stdout = true;
  o.merge_stderr = true;
  *job = std::make_unique<ferry::testing::Process>(
      std::vector<std::string>{
          "/bin/sh", "-c",
          h.job_cmd(2, "0,1", args + " --root " + root + kModel,
                    "FERRY_KILL_AT='" + point + "@" + std::to_string(rank) + "!stop'")},
      o);
  pid_t pid = 0;
  REQUIRE(ferry::testing::eventually([&] { return (pid = stopped_with(root)) > 0; }));
  return pid;
}

// A save of step 2 (seed 8) in which rank 2 stops at `point`.
pid_t start_stopped_save(const Hosts& h, const std::string& root, const std::string& point,
                         std::unique_ptr<ferry::testing::Process>* job) {
  return start_stopped(h, root, "--mode save --step 2 --seed 8", point, job);
}

// What a job printed once host 1's link was cut while its rank stood
// stopped at a kill point, and the seconds from the cut to the job's end.
struct CutRun {
  std::string out;
  double seconds = 0;
};

// Cuts host 1's link and lets the stopped rank go on.
void cut_host1(const Hosts& h, pid_t stopped) {
  h.tool("link " + h.name() + " 1 down");
  // Its parent (nsenter, which stopped itself when its child stopped)
  // goes on and continues it.
  ::kill(parent_of(stopped), SIGCONT);
}

// Cuts host 1's link, lets the stopped rank go on and reads the job to its
// end, which must be a failure.
CutRun cut_host1_and_continue(const Hosts& h, ferry::testing::Process& job, pid_t stopped) {
  const auto t0 = ferry::testing::Clock::now();
  cut_host1(h, stopped);
  CutRun r;
  REQUIRE(job.read_all(&r.out, 90));
  INFO(r.out);
  CHECK(job.wait_exit(10).value_or(0) != 0);
  r.seconds = ferry::testing::seconds_since(t0);
  return r;
}

// Host 0's ranks (0, 1) each report one `op` ("save", "load") error naming
// one of host 1's ranks; their lines, for what a case checks further.
std::vector<std::string> host0_errors_name_host1(const std::string& out, const std::string& op) {
  std::vector<std::string> found;
  for (int r : {0, 1}) {
    INFO("rank " << r);
    const auto errors = lines_with(out, "[rank " + std::to_string(r) + "] ERROR " + op + ":");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains("rank 2") || Catch::Contains("rank 3"));
    found.push_back(errors[0]);
  }
  return found;
}

void check_nothing_pending(const std::string& root) {
  for (const auto& e : fs::directory_iterator(root))
    CHECK_FALSE(ferry::is_pending_dir_name(e.path().filename().string()));
}

void check_loaded(const RunResult& l, int ranks) {
  INFO(l.out);
  CHECK(l.code == 0);
  CHECK(count(l.out, "every byte equal") == static_cast<size_t>(ranks));
}

// A job saved step 1 (seed 7) on 2 hosts x 2 ranks into `root`.
void save_first(const Hosts& h, const std::string& root) {
  const RunResult s = h.job(2, "0,1", "--mode save --step 1 --seed 7 --root " + root + kModel);
  INFO(s.out);
  REQUIRE(s.code == 0);
  REQUIRE(count(s.out, "SAVED") == 4);
}

}  // namespace

TEST_CASE("hosts: 2 hosts x 2 ranks save, 3 hosts x 1 and 1 host x 4 load it resharded",
          "[hosts]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(3, d.path());
  save_first(h, d.path());
  const ferry::Manifest m = ferry::testing::manifest_of(latest_path(d.path()));
  CHECK(m.world_size == 4);
  // Replicated tensors written once, by one rank of one host.
  for (const auto& t : m.tensors)
    if (t.key == "rep_huge" || t.key == "layers.0.bias") CHECK(t.chunks.size() == 1);

  // Rows saved become columns loaded and back (--layout swap).
  const RunResult three = h.job(1, "", "--mode load --seed 7 --root " + d.path() + kModel);
  check_loaded(three, 3);
  // Alone on its host, each rank reads every replicated byte itself and
  // shares no ring with anyone.
  const auto stats = ferry::testing::load_stats(three.out, 3);
  REQUIRE(stats.size() == 3);
  for (const auto& [rank, s] : stats) {
    INFO("rank " << rank);
    CHECK(s.received == 0);
    CHECK(s.in_memory == 0);
  }
  const auto peers = ring_peers(three.out, 3);
  REQUIRE(peers.size() == 3);
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(peers.at(r).first == h.name() + "-" + std::to_string(r));
    CHECK(peers.at(r).second.empty());
  }

  // Four ranks on the third host (rank 0 there too).
  check_loaded(h.job(4, "2", "--mode load --seed 7 --root " + d.path() + kModel), 4);
}

TEST_CASE("hosts: each host reads the replicated bytes once, and shares rings only inside",
          "[hosts][load]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  save_first(h, d.path());
  const uint64_t one_copy = data_bytes(ferry::testing::manifest_of(latest_path(d.path())));

  // Every rank loads every tensor whole.
  const uint64_t link0 = h.link_bytes(1);
  const RunResult l =
      h.job(2, "0,1", "--mode load --layout full --seed 7 --root " + d.path() + kModel);
  const uint64_t link_during = h.link_bytes(1) - link0;
  check_loaded(l, 4);
  const auto stats = ferry::testing::load_stats(l.out, 4);
  REQUIRE(stats.size() == 4);
  for (int host = 0; host < 2; ++host) {
    const LoadStats& a = stats.at(2 * host);
    const LoadStats& b = stats.at(2 * host + 1);
    INFO("host " << host << ": read " << a.read << " + " << b.read << ", received " << a.received
                 << " + " << b.received << ", one copy " << one_copy);
    CHECK(a.read + a.received == one_copy);
    CHECK(b.read + b.received == one_copy);
    CHECK(a.read + b.read == one_copy);  // one copy read per host, not per rank or per job
  }
  // Rings offered only between the ranks of one host.
  const auto peers = ring_peers(l.out, 4);
  REQUIRE(peers.size() == 4);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << " on node " << peers.at(r).first);
    CHECK(peers.at(r).first == h.name() + "-" + std::to_string(r / 2));
    CHECK(peers.at(r).second == std::set<int>{r ^ 1});
  }
  // The shared bytes stayed inside each host: host 1's link carried the
  // control traffic, not the copy its ranks passed each other.
  INFO("host 1's link carried " << link_during << " bytes during the load");
  CHECK(link_during < one_copy / 4);
}

TEST_CASE("hosts: a host whose link goes down during a save fails it on every rank, naming it",
          "[hosts][partition]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  save_first(h, d.path());
  for (const char* point : {"plan.sent", "writer.report"}) {
    INFO("link cut while rank 2 stands at " << point);
    std::unique_ptr<ferry::testing::Process> job;
    const pid_t stopped = start_stopped_save(h, d.path(), point, &job);
    const auto [out, seconds] = cut_host1_and_continue(h, *job, stopped);
    INFO(out);
    CHECK(count(out, "SAVED") == 0);
    // Host 0's ranks name the lost host's ranks and the phase, within a
    // few heartbeat timeouts (3 s), far from plan-timeout and write-timeout.
    for (const std::string& e : host0_errors_name_host1(out, "save"))
      CHECK_THAT(e, Catch::Contains(std::string(point) == "plan.sent" ? "plan" : "write"));
    // Host 1's ranks lose rank 0 and fail too.
    for (int r : {2, 3}) CHECK(count(out, "[rank " + std::to_string(r) + "] ERROR save:") == 1);
    CHECK(seconds < 20);
    // Nothing committed: step 1 is still the latest, and loads once the link is back.
    h.tool("link " + h.name() + " 1 up");
    CHECK(ferry::testing::manifest_of(latest_path(d.path())).step == 1);
    check_nothing_pending(d.path());
    check_loaded(h.job(1, "0,1", "--mode load --seed 7 --root " + d.path() + kModel), 2);
  }
}

TEST_CASE(
    "hosts: rank 0 cut off in the commit phase: the others report the outcome unknown, "
    "the root holds the truth, and the job resumes after a restart",
    "[hosts][partition]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  save_first(h, d.path());
  // Rank 0 has every write result and stands inside the commit, before the
  // commit point; ranks 1-3 wait for its answer. Host 1 (ranks 2, 3) loses
  // rank 0 before that answer can reach it.
  std::unique_ptr<ferry::testing::Process> job;
  const pid_t stopped = start_stopped(h, d.path(), "--mode save --step 2 --seed 8",
                                      "manifest.write", &job, /*rank=*/0);
  const auto [out, seconds] = cut_host1_and_continue(h, *job, stopped);
  INFO(out);
  // Rank 0 had what it needed and committed. (Rank 1 hears it over its own
  // host, unless rank 0 stood still past heartbeat-timeout: then it cannot
  // know either.)
  CHECK(count(out, "[rank 0] SAVED") == 1);
  CHECK(count(out, "[rank 1] SAVED") + count(out, "[rank 1] ERROR save: outcome_unknown") == 1);
  // Ranks 2 and 3 cannot know: their error names rank 0 and the commit
  // phase, says the outcome is unknown, and comes within a few heartbeat
  // timeouts (3 s), far from commit-timeout (60 s) plus the write time left.
  for (int r : {2, 3}) {
    INFO("rank " << r);
    const auto errors = lines_with(out, "[rank " + std::to_string(r) + "] ERROR save:");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains("outcome_unknown") && Catch::Contains("commit phase") &&
                              Catch::Contains("rank 0") && Catch::Contains("check the root"));
  }
  CHECK(seconds < 20);
  // The root says what happened: step 2 is committed whole, nothing pending.
  h.tool("link " + h.name() + " 1 up");
  CHECK(ferry::testing::manifest_of(latest_path(d.path())).step == 2);
  check_nothing_pending(d.path());
  // The job restarts on both hosts, resumes from step 2 and saves on.
  check_loaded(h.job(2, "0,1", "--mode load --seed 8 --root " + d.path() + kModel), 4);
  const RunResult next =
      h.job(2, "0,1", "--mode save --step 3 --seed 9 --root " + d.path() + kModel);
  INFO(next.out);
  CHECK(next.code == 0);
  CHECK(count(next.out, "SAVED") == 4);
  CHECK(ferry::testing::manifest_of(latest_path(d.path())).step == 3);
}

TEST_CASE("hosts: a host whose link goes down during a load fails it on every rank, naming it",
          "[hosts][partition]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  save_first(h, d.path());
  // Every rank loads the whole state; rank 2 stands after its first read.
  std::unique_ptr<ferry::testing::Process> job;
  const pid_t stopped =
      start_stopped(h, d.path(), "--mode load --layout full --seed 7", "load.read", &job);
  const auto [out, seconds] = cut_host1_and_continue(h, *job, stopped);
  INFO(out);
  CHECK(seconds < 20);
  CHECK(count(out, "every byte equal") == 0);
  host0_errors_name_host1(out, "load");
  for (int r : {2, 3}) CHECK(count(out, "[rank " + std::to_string(r) + "] ERROR load:") == 1);
  // With the link back, the checkpoint loads.
  h.tool("link " + h.name() + " 1 up");
  check_loaded(h.job(2, "0,1", "--mode load --layout full --seed 7 --root " + d.path() + kModel),
               4);
}

TEST_CASE("hosts: a host killed during a save, the job restarts on the rest with another size",
          "[hosts][dead]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  save_first(h, d.path());
  // Rank 2 stands still after its data file is written, in the write phase.
  std::unique_ptr<ferry::testing::Process> job;
  (void)start_stopped_save(h, d.path(), "writer.report", &job);
  const auto t0 = ferry::testing::Clock::now();
  h.tool("kill " + h.name() + " 1");  // SIGKILL, every process of host 1
  std::string out;
  REQUIRE(job->read_all(&out, 90));
  INFO(out);
  CHECK(job->wait_exit(10).value_or(0) != 0);
  CHECK(ferry::testing::seconds_since(t0) < 20);
  CHECK(count(out, "SAVED") == 0);
  host0_errors_name_host1(out, "save");
  CHECK(ferry::testing::manifest_of(latest_path(d.path())).step == 1);
  check_nothing_pending(d.path());
  // The job restarts on host 0 alone, 3 ranks: it resumes from step 1 and
  // saves on.
  check_loaded(h.job(3, "0", "--mode load --seed 7 --root " + d.path() + kModel), 3);
  const RunResult next = h.job(3, "0", "--mode save --step 2 --seed 9 --root " + d.path() + kModel);
  INFO(next.out);
  CHECK(next.code == 0);
  CHECK(ferry::testing::manifest_of(latest_path(d.path())).step == 2);
}

TEST_CASE("hosts: ferry demo --hosts trains on 2 hosts through a partition and restores on 3",
          "[hosts][demo]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  const RunResult r =
      run_shell(std::string(FERRY_CLI_PATH) +
                    " demo --hosts 2 --ranks 4 --state-mib 16 --layers 2 --root " + d.sub("ck"),
                {}, 300);
  INFO(r.out);
  REQUIRE(r.code == 0);
  // The partition came after the first checkpoint and stopped the training:
  // the restore finds step 10, the last committed, and checks every byte.
  CHECK(count(r.out, "step 10 committed: host 1's link is DOWN") == 1);
  CHECK(count(r.out, "training stopped, as it must, at the partition") == 1);
  CHECK(count(r.out, "restored step 10") == 3);
  CHECK(count(r.out, "every byte matches the saved state") == 3);
  // Per host: what its rank read (each rank on a host of its own), and what
  // crossed its link.
  std::set<std::string> hosts;
  for (int i = 0; i < 3; ++i) {
    const auto read = lines_with(r.out, "] rank " + std::to_string(i) + " on host ");
    REQUIRE(read.size() == 1);
    const auto at = read[0].find(" on host ") + 9;
    hosts.insert(read[0].substr(at, read[0].find(':', at) - at));
  }
  CHECK(hosts.size() == 3);
  CHECK(lines_with(r.out, "over its link during the restore").size() == 3);
  CHECK_THAT(r.out, Catch::Contains("restored on 3, every byte checked"));
}

TEST_CASE("hosts: each host has its own name, address, processes and node-local directory",
          "[hosts]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  for (int i = 0; i < 2; ++i)
    h.tool("run " + h.name() + " " + std::to_string(i) +
           " -- sh -c 'echo $(hostname) > $FERRY_NODE_DIR/who; hostname > $FERRY_SHARED_DIR/h" +
           std::to_string(i) + "'");
  for (int i = 0; i < 2; ++i) {
    const RunResult r = run_shell(kTool + " run " + h.name() + " " + std::to_string(i) +
                                  " -- sh -c 'cat $FERRY_NODE_DIR/who; ip -4 -o addr show eth0; "
                                  "ls /proc | grep -c -E ^[0-9]+$'");
    INFO(r.out);
    REQUIRE(r.code == 0);
    const std::string me = h.name() + "-" + std::to_string(i);
    const auto lines = ferry::testing::lines_of(r.out);
    REQUIRE(lines.size() == 3);
    CHECK(lines[0] == me);  // its own file, not the other host's
    CHECK_THAT(lines[1], Catch::Contains("10.77.0." + std::to_string(i + 1) + "/24"));
    CHECK(std::stoi(lines[2]) <= 5);  // its PID 1, the shell, its children: not this machine's
    std::ifstream shared(d.sub("h" + std::to_string(i)));
    std::string name;
    shared >> name;
    CHECK(name == me);  // the shared directory is this one
  }
}

TEST_CASE("hosts: hosts left behind by a dead owner are removed by the next start", "[hosts]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  // An owner that is gone at once: a crashed test.
  const std::string name = "zz" + std::to_string(::getpid() % 100000);
  const RunResult up = run_shell(kTool + " up " + name + " 2 --shared " + d.path() + " --owner $$");
  INFO(up.out);
  REQUIRE(up.code == 0);
  const std::string left = "fh" + name;
  CHECK_THAT(run_shell("ip netns list; ip -o link show").out, Catch::Contains(left + "h1"));
  Hosts h(1, d.path());  // its start cleans up after dead owners
  const RunResult after = run_shell("ip netns list; ip -o link show");
  INFO(after.out);
  CHECK_THAT(after.out, !Catch::Contains(left));
  CHECK_FALSE(fs::exists("/run/ferry-hosts/" + name));
}

namespace {

// Where link shaping (tc, nft) cannot run: the reason, as for the hosts.
std::string shaping_unavailable() {
  const RunResult r = run_shell(kTool + " check --shape");
  if (r.code == 0) return "";
  return r.out.empty() ? "hosts.sh check --shape exited " + std::to_string(r.code) : r.out;
}

// The largest `field=` value (ms) over the SAVED lines of `out`, and how many there were.
std::pair<double, size_t> slowest(const std::string& out, const std::string& field) {
  double most = 0;
  const auto saved = lines_with(out, "] SAVED ");
  for (const std::string& l : saved) {
    const auto at = l.find(" " + field + "=");
    if (at != std::string::npos) most = std::max(most, std::stod(l.substr(at + field.size() + 2)));
  }
  return {most, saved.size()};
}

// A variable of `pid`'s environment ("" if unset).
std::string env_of(pid_t pid, const std::string& name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
  std::string entry;
  while (std::getline(in, entry, '\0'))
    if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
  return "";
}

// Per host: bytes its ranks read from storage, took whole from another host,
// and sent whole to other hosts (LOADSTATS), `per_host` ranks on each.
struct HostLoad {
  uint64_t read = 0, fetched = 0, sent = 0;
};

std::vector<HostLoad> host_loads(const std::map<int, LoadStats>& stats, int per_host) {
  std::vector<HostLoad> hosts;
  for (const auto& [rank, s] : stats) {
    hosts.resize(std::max<size_t>(hosts.size(), rank / per_host + 1));
    HostLoad& h = hosts[rank / per_host];
    h.read += s.read;
    h.fetched += s.fetched;
    h.sent += s.hosts_sent;
  }
  return hosts;
}

}  // namespace

TEST_CASE(
    "hosts: 2 hosts x 2 ranks save and load resharded through a 1 Gbit/s link losing 2% each "
    "way, plan and commit timed",
    "[hosts][shape]") {
  FERRY_NEED_HOSTS();
  if (const std::string why = shaping_unavailable(); !why.empty()) {
    if (hosts_required()) FAIL("FERRY_REQUIRE_HOSTS=1 but " << why);
    FERRY_SKIP(why << " (FERRY_REQUIRE_HOSTS=1 makes this a failure)");
  }
  TempDir d;
  Hosts h(2, d.path());
  // A model with 1000 small entries as well: a plan of some size crosses the link.
  const std::string model = kModel + " --many 1000 --root " + d.path();
  const RunResult plain = h.job(2, "0,1", "--mode save --step 1 --seed 7" + model);
  INFO(plain.out);
  REQUIRE(plain.code == 0);
  // Every byte between the hosts crosses host 1's link: shaped, both ways.
  h.tool("shape " + h.name() + " 1 rate 1gbit");
  h.tool("shape " + h.name() + " 1 loss 2%");
  const uint64_t link0 = h.link_bytes(1);
  const RunResult shaped = h.job(2, "0,1", "--mode save --step 2 --seed 8" + model);
  INFO(shaped.out);
  REQUIRE(shaped.code == 0);
  CHECK(ferry::testing::manifest_of(latest_path(d.path())).step == 2);
  // Loaded resharded (rows become columns) on 2 x 2, and on 2 x 1.
  check_loaded(h.job(2, "0,1", "--mode load --seed 8" + model), 4);
  check_loaded(h.job(1, "0,1", "--mode load --seed 8" + model), 2);
  const uint64_t carried = h.link_bytes(1) - link0;
  const RunResult dropped = run_shell(kTool + " shape " + h.name() + " 1 show");
  INFO(dropped.out);
  REQUIRE(dropped.code == 0);
  // The loss was there: packets of this job were dropped on the way.
  CHECK(std::stoull(dropped.out.substr(dropped.out.find("dropped=") + 8)) > 0);
  // The same save again on the plain link, with a checkpoint before it as
  // the shaped one had.
  h.tool("shape " + h.name() + " 1 clear");
  const RunResult again = h.job(2, "0,1", "--mode save --step 3 --seed 9" + model);
  INFO(again.out);
  REQUIRE(again.code == 0);
  // Plan and commit of the slowest rank in each save.
  std::ostringstream times;
  for (const auto& [what, run] :
       {std::pair<const char*, const RunResult*>{"plain link, step 1", &plain},
        {"1 Gbit/s + 2% loss each way, step 2", &shaped},
        {"plain link, step 3", &again}}) {
    const auto [plan, saved] = slowest(run->out, "plan_ms");
    const auto [commit, saved_too] = slowest(run->out, "commit_ms");
    CHECK(saved == 4);
    times << "; " << what << ": plan " << plan << " ms, commit " << commit << " ms";
  }
  WARN("save on 2 hosts x 2 ranks, slowest rank"
       << times.str() << "; shaped, host 1's link carried " << carried << " bytes, "
       << dropped.out);
}

TEST_CASE(
    "hosts: foreign bytes from another host at every port a rank listens on: ignored, logged, "
    "and the save commits and loads",
    "[hosts][hostile]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(3, d.path());
  // The job on hosts 0 and 1 stands joined, every rank listening, until `go`.
  const std::string go = d.sub("go");
  ferry::testing::ProcessOptions o;
  o.capture_stdout = true;
  o.merge_stderr = true;
  ferry::testing::Process job({"/bin/sh", "-c",
                               h.job_cmd(2, "0,1",
                                         "--mode save --step 1 --seed 7 --root " + d.path() +
                                             kModel + " --wait-for " + go)},
                              o);
  std::string out;
  for (int ready = 0; ready < 4;) {
    const auto line = job.read_line(60);
    REQUIRE(line);
    out += *line + "\n";
    if (line->find("] READY") != std::string::npos) ++ready;
  }
  // Every TCP port of every rank that another host can reach, found from
  // the ranks themselves (their sockets in their hosts' namespaces).
  const std::vector<pid_t> ranks = workers_with(d.path());
  REQUIRE(ranks.size() == 4);
  std::vector<std::string> targets;
  bool handshake_port = false;
  for (pid_t pid : ranks) {
    const std::string addr = env_of(pid, "FERRY_HOST_ADDR");
    REQUIRE(!addr.empty());
    size_t reachable = 0;
    for (const auto& a : ferry::testing::listening_sockets(pid, addr)) {
      if (a.ss_family != AF_INET) continue;
      char text[INET_ADDRSTRLEN] = {0};
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, text, sizeof(text));
      if (std::string(text) != addr) continue;  // loopback only: no other host reaches it
      const uint16_t port = ferry::testing::port_of(a);
      targets.push_back(addr + ":" + std::to_string(port));
      handshake_port = handshake_port || (addr == "10.77.0.1" && port == 29501);
      ++reachable;
    }
    INFO("rank worker pid " << pid << " on " << addr);
    CHECK(reachable > 0);
  }
  CHECK(handshake_port);  // rank 0's join port (MASTER_PORT + 1) among them

  // From host 2, which runs no rank of the job.
  std::vector<std::string> argv = {kTool, "run", h.name(), "2", "--", FERRY_FOREIGN_SENDER_PATH};
  argv.insert(argv.end(), targets.begin(), targets.end());
  ferry::testing::ProcessOptions so;
  so.capture_stdout = true;
  so.merge_stderr = true;
  so.pipe_stdin = true;
  ferry::testing::Process sender(argv, so);
  std::string joins;
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto line = sender.read_line(120);
    REQUIRE(line);
    joins += *line + "\n";
  }
  INFO(joins);
  // Rank 0's join port refused the wrong token, naming it; no other port took it.
  CHECK(count(joins, "JOIN REFUSED by 10.77.0.1:29501 ") == 1);
  CHECK(count(joins, "JOIN REFUSED") == 1);
  const auto sent = sender.read_line(120);
  REQUIRE(sent);
  INFO(*sent);
  CHECK(sent->rfind("SENT ", 0) == 0);
  const auto held = sender.read_line(60);
  REQUIRE(held);
  CHECK(held->rfind("HELD ", 0) == 0);
  for (pid_t pid : ranks) CHECK(::kill(pid, 0) == 0);  // every rank lived through it

  // The save goes on while the foreign connections stay open.
  std::ofstream(go) << "go\n";
  std::string rest;
  REQUIRE(job.read_all(&rest, 120));
  out += rest;
  INFO(out);
  CHECK(job.wait_exit(10) == std::optional<int>(0));
  CHECK(count(out, "SAVED") == 4);
  sender.say("done");
  CHECK(sender.wait_exit(30) == std::optional<int>(0));
  // Rank 0 logged the foreign connections, naming where they came from,
  // and the Join with the wrong token as such.
  CHECK(count(out, "[rank 0] ") > 0);
  CHECK_THAT(out, Catch::Contains("closed a connection from 10.77.0.3"));
  CHECK_THAT(out, Catch::Contains("presented a different job token"));
  check_nothing_pending(d.path());
  check_loaded(h.job(1, "0,1", "--mode load --seed 7 --root " + d.path() + kModel), 2);
}

TEST_CASE(
    "hosts: with load-sharing = job the job reads each byte from storage once and hosts send "
    "each other the rest",
    "[hosts][load]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(3, d.path());
  save_first(h, d.path());
  const uint64_t one_copy = data_bytes(ferry::testing::manifest_of(latest_path(d.path())));
  const std::string job = " --set load-sharing=job --root " + d.path() + kModel;

  SECTION("2 hosts x 2 ranks, every rank loads every tensor whole") {
    const uint64_t link0 = h.link_bytes(1);
    const RunResult l = h.job(2, "0,1", "--mode load --layout full --seed 7" + job);
    const uint64_t link_during = h.link_bytes(1) - link0;
    check_loaded(l, 4);
    const auto hosts = host_loads(ferry::testing::load_stats(l.out, 4), 2);
    REQUIRE(hosts.size() == 2);
    for (int i = 0; i < 2; ++i) {
      const HostLoad& me = hosts[i];
      const HostLoad& other = hosts[1 - i];
      INFO("host " << i << ": read " << me.read << ", fetched " << me.fetched << ", sent "
                   << me.sent << "; one copy " << one_copy);
      // Each host reads its part from storage and takes the rest from the other.
      CHECK(me.read > 0);
      CHECK(me.read + me.fetched == one_copy);
      CHECK(me.sent == other.fetched);
    }
    CHECK(hosts[0].read + hosts[1].read == one_copy);  // once per job, not once per host
    // Those bytes crossed host 1's link, once each way.
    INFO("host 1's link carried " << link_during << " bytes during the load");
    CHECK(link_during >= hosts[1].fetched + hosts[1].sent);
    CHECK(link_during < 2 * one_copy);
  }
  SECTION("3 hosts x 1 rank, resharded (rows saved load as columns)") {
    const RunResult l = h.job(1, "", "--mode load --seed 7" + job);
    check_loaded(l, 3);
    const auto stats = ferry::testing::load_stats(l.out, 3);
    const auto hosts = host_loads(stats, 1);
    REQUIRE(hosts.size() == 3);
    uint64_t read = 0, fetched = 0, sent = 0;
    for (int i = 0; i < 3; ++i) {
      INFO("host " << i << ": read " << hosts[i].read << ", fetched " << hosts[i].fetched);
      CHECK(hosts[i].read > 0);  // the replicated bytes spread over the hosts
      CHECK(hosts[i].fetched > 0);
      read += hosts[i].read;
      fetched += hosts[i].fetched;
      sent += hosts[i].sent;
    }
    // The shards together and the replicated tensors once: one copy.
    CHECK(read == one_copy);
    CHECK(sent == fetched);
  }
}

TEST_CASE(
    "hosts: with load-sharing = job a host cut off while it reads for the others fails the "
    "load on every rank, naming it",
    "[hosts][load][partition]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  save_first(h, d.path());
  // Every rank loads the whole state; rank 2 (host 1) stands after its first
  // read, with bytes host 0 waits for still unsent.
  std::unique_ptr<ferry::testing::Process> job;
  const pid_t stopped = start_stopped(
      h, d.path(), "--mode load --layout full --seed 7 --set load-sharing=job", "load.read", &job);
  const auto [out, seconds] = cut_host1_and_continue(h, *job, stopped);
  INFO(out);
  CHECK(seconds < 20);
  CHECK(count(out, "every byte equal") == 0);
  // Host 0 was waiting for bytes host 1 reads for it, and says so.
  for (const std::string& e : host0_errors_name_host1(out, "load"))
    CHECK_THAT(e, Catch::Contains("another host"));
  for (int r : {2, 3}) CHECK(count(out, "[rank " + std::to_string(r) + "] ERROR load:") == 1);
  // With the link back, the same load works.
  h.tool("link " + h.name() + " 1 up");
  check_loaded(h.job(2, "0,1",
                     "--mode load --layout full --seed 7 --set load-sharing=job --root " +
                         d.path() + kModel),
               4);
}

namespace {

// Reads the job's lines into *out until `done` holds for them, or its end
// or timeout_s.
bool read_until(ferry::testing::Process& job, std::string* out, double timeout_s,
                const std::function<bool(const std::string&)>& done) {
  const auto t0 = ferry::testing::Clock::now();
  while (!done(*out)) {
    const auto line = job.read_line(timeout_s - ferry::testing::seconds_since(t0));
    if (!line) return false;
    *out += *line + "\n";
  }
  return true;
}

}  // namespace

TEST_CASE("hosts: after a partition fails a save, the link comes back and the same job saves on",
          "[hosts][partition]") {
  FERRY_NEED_HOSTS();
  TempDir d;
  Hosts h(2, d.path());
  save_first(h, d.path());
  // Step 2 fails: host 1 (ranks 2, 3) is cut off in the plan phase. Every
  // rank reports it and waits for the go file, in the same processes.
  const std::string go = d.path() + "/go";
  std::unique_ptr<ferry::testing::Process> job;
  const pid_t stopped = start_stopped(
      h, d.path(), "--mode save --step 2 --seed 8 --then-wait-for " + go, "plan.sent", &job);
  cut_host1(h, stopped);
  std::string out;
  const auto failed_on_all = [](const std::string& o) { return count(o, "] ERROR save:") == 4; };
  CHECK(read_until(*job, &out, 60, failed_on_all));
  INFO(out);
  REQUIRE(failed_on_all(out));
  host0_errors_name_host1(out, "save");
  // The link comes back: host 1's ranks join rank 0 again by themselves.
  h.tool("link " + h.name() + " 1 up");
  const auto rejoined = [](const std::string& o) {
    for (int r : {2, 3}) {
      bool seen = false;
      for (const auto& l : lines_with(o, "[rank 0] "))
        seen = seen || l.find("rank " + std::to_string(r) + " rejoined") != std::string::npos;
      if (!seen) return false;
    }
    return true;
  };
  CHECK(read_until(*job, &out, 60, rejoined));
  REQUIRE(rejoined(out));
  { std::ofstream(go).put('\n'); }
  // Step 3 commits on every rank; the failed step 2 never did.
  std::string rest;
  REQUIRE(job->read_all(&rest, 90));
  out += rest;
  CHECK(job->wait_exit(10).value_or(1) == 0);
  CHECK(count(out, "ERROR next save") == 0);
  CHECK(count(out, "SAVED") == 4);
  CHECK(ferry::testing::manifest_of(latest_path(d.path())).step == 3);
  CHECK_FALSE(fs::exists(fs::path(d.path()) / ferry::step_dir_name(2)));
  CHECK(fs::exists(fs::path(d.path()) / ferry::step_dir_name(3)));
  check_nothing_pending(d.path());
  check_loaded(h.job(2, "0,1", "--mode load --seed 8 --root " + d.path() + kModel), 4);
}
