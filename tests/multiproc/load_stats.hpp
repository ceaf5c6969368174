// What the ranks of a launched load printed about it (rank_worker's LOADSTATS
// line), and the checkpoint figures to compare it with; shared by the
// multiproc load tests.
#pragma once

#include <catch2/catch.hpp>

#include <map>
#include <string>

#include "catalog.hpp"
#include "manifest.hpp"
#include "multiproc/launch.hpp"

namespace ferry::testing {

struct LoadStats {
  uint64_t read = 0, received = 0, disk = 0, queued = 0, hwm_growth = 0, relayed = 0;
  uint64_t in_memory = 0;  // bytes it put in its receivers' share rings
  // load-sharing = job: bytes another host read for it, bytes it sent to other hosts
  uint64_t fetched = 0, hosts_sent = 0;
};

// The LOADSTATS line of each of ranks 0..ranks-1 that printed exactly one.
inline std::map<int, LoadStats> load_stats(const std::string& out, int ranks) {
  std::map<int, LoadStats> stats;
  for (int r = 0; r < ranks; ++r) {
    const auto lines = lines_with(out, "[rank " + std::to_string(r) + "] LOADSTATS");
    if (lines.size() != 1) continue;
    LoadStats s;
    const std::string& l = lines[0];
    auto field = [&](const std::string& name) {
      const auto at = l.find(" " + name + "=");
      return at == std::string::npos ? 0 : std::stoull(l.substr(at + name.size() + 2));
    };
    s.read = field("read");
    s.received = field("received");
    s.disk = field("disk");
    s.queued = field("queued");
    s.hwm_growth = field("hwm_growth");
    s.relayed = field("relayed");
    s.in_memory = field("in_memory");
    s.fetched = field("fetched");
    s.hosts_sent = field("hosts_sent");
    stats[r] = s;
  }
  return stats;
}

inline Manifest manifest_of(const std::string& step_dir) {
  auto m = read_manifest(*posix_filesystem(), step_dir);
  REQUIRE(m.ok());
  return std::move(m).value();
}

// The data bytes of a checkpoint: one copy of the state.
inline uint64_t data_bytes(const Manifest& m) {
  uint64_t n = 0;
  for (const auto& t : m.tensors)
    for (const auto& c : t.chunks) n += c.byte_length;
  return n;
}

// Four ranks load every tensor whole from `root` (saved with `model`) with a
// 256 KiB share window, and rank 2 dies as its third frame of shared bytes
// arrives: the others each have a full window toward it, so their readers
// wait for acks that will not come. Its death must end those waits (the
// heartbeat timeout is 3 s), not write-timeout (30 s), and must crash or
// abort no other rank. `settings` (worker flags) pick the lanes.
inline void check_receiver_death_releases_senders(const std::string& root, const std::string& model,
                                                  const std::string& settings = "") {
  constexpr int kRanks = 4;
  auto l = launch(
      kRanks,
      "--mode load --layout full --root " + root + model + " --set share-window=256KiB " + settings,
      "FERRY_KILL_AT=load.receive:3@2");
  INFO(l.out);
  CHECK(l.code != 0);
  CHECK(count(l.out, "killed by signal 9") == 1);
  CHECK(count(l.out, "killed by signal") == 1);  // the others end by themselves
  CHECK(count(l.out, "every byte equal") == 0);
  for (int r = 0; r < kRanks; ++r) {
    if (r == 2) continue;
    INFO("rank " << r);
    const auto errors = lines_with(l.out, "[rank " + std::to_string(r) + "] ERROR load:");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0],
               Catch::Contains("rank 2 failed") || Catch::Contains("failed peer: rank 2"));
  }
  CHECK(l.seconds < 20);
}

}  // namespace ferry::testing
