// The pure part of the timeline (src/trace.hpp): the clock offset from one
// round trip, the slowest rank, the JSON file, and phase clocks.

#include <catch2/catch.hpp>

#include <fstream>
#include <thread>
#include <vector>

#include "protocol.hpp"
#include "test_util.hpp"
#include "trace.hpp"
#include "trace_file.hpp"

using ferry::RankTrace;
using ferry::TraceSpan;

TEST_CASE("clock offset: the midpoint of the round trip, off by at most half of it", "[trace]") {
  // Rank 0's clock runs 5 s ahead; the trip took 100 us each way.
  const auto c = ferry::clock_offset(1'000'000, 5'001'100'000, 1'200'000);
  CHECK(c.offset_ns == 5'000'000'000);
  CHECK(c.error_ns == 100'000);
  // A clock behind, and a reply timed before the send (never negative error).
  const auto d = ferry::clock_offset(900, 100, 700);
  CHECK(d.offset_ns == 100 - 800);
  CHECK(d.error_ns == 100);
}

TEST_CASE("the slowest rank is the one whose own work ends last, not rank 0's commit", "[trace]") {
  std::vector<RankTrace> ranks(3);
  for (int r = 0; r < 3; ++r) {
    ranks[r].rank = r;
    ranks[r].spans.push_back({"plan", "save", 100, 200, 0, -1});
  }
  ranks[1].spans.push_back({"fsync f1", "f1", 300, 900, 0, -1});
  ranks[2].spans.push_back({"fsync f2", "f2", 300, 700, 0, -1});
  ranks[0].spans.push_back({"commit", "commit", 900, 5000, 0, -1});
  const ferry::Slowest s = ferry::slowest_rank(ranks, "commit");
  CHECK(s.rank == 1);
  CHECK(s.phase == "fsync f1");
  CHECK(s.ms == Approx((900 - 100) / 1e6));
  CHECK(ferry::slowest_rank({}, "commit").rank == -1);
}

TEST_CASE("the trace file is JSON with every span, names escaped, and the slowest rank",
          "[trace]") {
  ferry::testing::TempDir d;
  std::vector<RankTrace> ranks(2);
  ranks[0] = {0, "host \"a\"", 0, {{"plan", "save", 5000, 9000, 0, -1}}};
  ranks[1] = {1,
              "b\n",
              2000,
              {{"plan", "save", 4000, 8000, 0, -1},
               {"write odd \"name\"\\.safetensors", "f", 8000, 20000, 123, 0.5}}};
  const ferry::TraceHeader h{"save", "id\"1", 12, "/root/step-12", "commit"};
  CHECK(ferry::trace_file_name(h) == "save-00000012-id_1.json");
  auto fs = ferry::posix_filesystem();
  REQUIRE(ferry::write_trace_file(*fs, d.sub("t/u"), "x.json", ferry::render_chrome_trace(h, ranks))
              .ok());
  const auto t = ferry::testing::read_trace_file(d.sub("t/u/x.json"));
  CHECK(t.kind == "save");
  CHECK(t.slowest_rank == 1);
  CHECK(t.slowest_phase == "write odd \"name\"\\.safetensors");
  REQUIRE(t.spans.size() == 3);
  const auto* w = t.find(1, "write odd \"name\"\\.safetensors");
  REQUIRE(w != nullptr);
  CHECK(w->start_ns == 8000 - 4000);  // from the earliest span of any rank
  CHECK(w->end_ns == 20000 - 4000);
  CHECK(w->clock_error_ns == 2000);
}

TEST_CASE("a span that ends before it starts is refused on decode, naming the rank", "[trace]") {
  ferry::CommitRequest m;
  m.result.rank = 1;
  m.trace = {1, "h", 0, {{"plan", "save", 10, 5, 0, -1}}};
  auto r = ferry::decode_message(ferry::encode_message(m));
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("rank 1") && Catch::Contains("'plan'"));
}

TEST_CASE("a phase clock spans its threads' first start to last end and sums their time",
          "[trace]") {
  ferry::PhaseClock c;
  CHECK_FALSE(c.used());
  std::vector<std::thread> ts;
  for (int i = 0; i < 4; ++i) ts.emplace_back([&c, i] { c.add(100 + i * 10, 200 + i * 10, 7); });
  for (auto& t : ts) t.join();
  CHECK(c.used());
  const TraceSpan s = c.span("read", "read", 1000);
  CHECK(s.start_ns == 1100);
  CHECK(s.end_ns == 1230);
  CHECK(s.bytes == 28);
  CHECK(s.busy_ms == Approx(400 / 1e6));
}

TEST_CASE("trace-dir values with control characters are refused", "[trace]") {
  CHECK(ferry::trace_dir_problem("").empty());
  CHECK(ferry::trace_dir_problem("/var/tmp/ferry traces").empty());
  CHECK_FALSE(ferry::trace_dir_problem("/tmp/a\nb").empty());
  auto o = ferry::resolve_options({{"trace-dir", "/tmp/x\t", "FERRY_CONFIG=/c.ini:3"}});
  REQUIRE_FALSE(o.ok());
  CHECK_THAT(o.status().message(),
             Catch::Contains("ferry.trace-dir") && Catch::Contains("FERRY_CONFIG=/c.ini:3"));
}
