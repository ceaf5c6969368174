// The timeline of a save and of a load (trace-dir) across real ranks: rank 0
// writes one Chrome trace file per save and load with every rank's phases on
// its clock, in the order they happen, and names the slowest rank.

#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include "multiproc/launch.hpp"
#include "process.hpp"
#include "test_util.hpp"
#include "trace_file.hpp"

using ferry::testing::count;
using ferry::testing::files_starting;
using ferry::testing::launch;
using ferry::testing::read_trace_file;
using ferry::testing::run_shell;
using ferry::testing::TempDir;
using ferry::testing::TracedSpan;
using ferry::testing::TraceFile;

namespace {

// `a` ends before `b` starts, up to how far the two ranks' clocks may be
// apart (each span carries its rank's error against rank 0's clock).
void check_before(const TracedSpan* a, const TracedSpan* b) {
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  INFO("rank " << a->rank << " '" << a->name << "' ends at " << a->end_ns << " ns, rank " << b->rank
               << " '" << b->name << "' starts at " << b->start_ns << " ns");
  CHECK(a->end_ns <= b->start_ns + a->clock_error_ns + b->clock_error_ns);
}

// The rank whose spans (but rank 0's commit) end last.
int last_to_finish(const TraceFile& t) {
  int rank = -1;
  int64_t end = -1;
  for (const auto& s : t.spans)
    if (s.name != "commit" && s.end_ns > end) {
      end = s.end_ns;
      rank = s.rank;
    }
  return rank;
}

}  // namespace

TEST_CASE("trace-dir: a 3-rank save's timeline has every rank's phases in order, on one clock",
          "[trace]") {
  TempDir d;
  const std::string traces = d.sub("traces");
  const auto saved = launch(
      3, "--mode save --step 4 --seed 7 --root " + d.sub("root") + " --set trace-dir=" + traces);
  INFO(saved.out);
  REQUIRE(saved.code == 0);
  const auto files = files_starting(traces, "save-00000004-");
  REQUIRE(files.size() == 1);
  const TraceFile t = read_trace_file(files[0]);
  CHECK(t.kind == "save");
  const TracedSpan* commit = t.find(0, "commit");
  REQUIRE(commit != nullptr);
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    const std::string file = "rank-0000" + std::to_string(r) + "-0000.safetensors";
    const TracedSpan* plan = t.find(r, "plan");
    const TracedSpan* snapshot = t.find(r, "snapshot");
    const TracedSpan* serialize = t.find(r, "serialize");
    const TracedSpan* write = t.find(r, "write " + file);
    const TracedSpan* fsync = t.find(r, "fsync " + file);
    check_before(plan, snapshot);
    check_before(plan, serialize);
    check_before(plan, write);
    check_before(write, fsync);
    check_before(snapshot, commit);
    check_before(serialize, commit);
    check_before(fsync, commit);  // rank 0 commits once every rank's files are durable
    // Only rank 0 commits.
    if (r > 0) CHECK(t.find(r, "commit") == nullptr);
  }
  CHECK(t.slowest_rank == last_to_finish(t));
  CHECK_FALSE(t.slowest_phase.empty());
}

TEST_CASE(
    "trace-dir: a 2-rank load's timeline has each rank's resolve, plan, read and verify, "
    "and the shared reads",
    "[trace]") {
  TempDir d;
  const std::string root = d.sub("root");
  const auto saved = launch(2, "--mode save --step 1 --seed 7 --root " + root);
  INFO(saved.out);
  REQUIRE(saved.code == 0);
  const std::string traces = d.sub("traces");
  // Rows become columns; the replicated tensors are read once and shared.
  const auto loaded =
      launch(2, "--mode load --seed 7 --root " + root + " --set trace-dir=" + traces);
  INFO(loaded.out);
  REQUIRE(loaded.code == 0);
  REQUIRE(count(loaded.out, "every byte equal") == 2);
  const auto files = files_starting(traces, "load-");
  REQUIRE(files.size() == 1);
  const TraceFile t = read_trace_file(files[0]);
  CHECK(t.kind == "load");
  int sharing = 0;
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    check_before(t.find(r, "resolve"), t.find(r, "plan"));
    check_before(t.find(r, "plan"), t.find(r, "read"));
    const TracedSpan* read = t.find(r, "read");
    const TracedSpan* verify = t.find(r, "verify");
    REQUIRE(verify != nullptr);
    CHECK(read->start_ns <= verify->start_ns);  // a block is checked after its read
    CHECK(read->end_ns <= verify->end_ns);
    if (const TracedSpan* share = t.find(r, "share")) {
      ++sharing;
      CHECK(verify->start_ns <= share->start_ns);  // only checked bytes leave
    }
  }
  CHECK(sharing >= 1);
  CHECK((t.slowest_rank == 0 || t.slowest_rank == 1));
}

TEST_CASE(
    "trace-dir: a rank whose clock is 5000 s ahead (its own time namespace) lands on rank "
    "0's time axis",
    "[trace]") {
  // CLOCK_MONOTONIC differs per time namespace as it does between hosts.
  const auto probe = run_shell("unshare --time --monotonic 5000 --fork true 2>&1");
  if (probe.code != 0) {
    FERRY_SKIP("no time namespace here (unshare --time needs root and Linux 5.6): " << probe.out);
  }
  TempDir d;
  const std::string traces = d.sub("traces");
  // Rank 1 runs in a time namespace whose monotonic clock is 5000 s ahead.
  const std::string wrapper =
      "'if [ \"$RANK\" = 1 ]; then exec unshare --time --monotonic 5000 --fork -- \"$0\" \"$@\"; "
      "fi; exec \"$0\" \"$@\"'";
  const auto saved =
      run_shell(std::string(FERRY_CLI_PATH) + " launch -n 3 -- /bin/sh -c " + wrapper + " " +
                FERRY_RANK_WORKER_PATH + " --mode save --step 5 --seed 7 --root " + d.sub("root") +
                " --set trace-dir=" + traces);
  INFO(saved.out);
  REQUIRE(saved.code == 0);
  const auto files = files_starting(traces, "save-00000005-");
  REQUIRE(files.size() == 1);
  const TraceFile t = read_trace_file(files[0]);
  const TracedSpan* commit = t.find(0, "commit");
  for (int r = 0; r < 3; ++r) {
    const std::string file = "rank-0000" + std::to_string(r) + "-0000.safetensors";
    // Every rank asked for its plan before any got its answer, and every
    // rank's files were durable before rank 0 committed: 5000 s off either
    // way breaks one of the two.
    for (int q = 0; q < 3; ++q) {
      const TracedSpan* asked = t.find(r, "plan");
      const TracedSpan* answered = t.find(q, "plan");
      REQUIRE(asked != nullptr);
      REQUIRE(answered != nullptr);
      INFO("rank " << r << " planned from " << asked->start_ns << ", rank " << q
                   << " had its plan at " << answered->end_ns);
      CHECK(asked->start_ns <= answered->end_ns + asked->clock_error_ns + answered->clock_error_ns);
    }
    check_before(t.find(r, "fsync " + file), commit);
  }
}
