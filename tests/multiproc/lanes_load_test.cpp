// Replicated bytes of a load travel between the ranks of a node over direct
// lanes (shared memory, or tcp with peer error handling), not through rank 0:
// four local ranks each get every byte, one copy is read from disk, and rank 0
// passes no shared frame on. With lanes off rank 0 relays them, as before.
// With share-memory (the default) the bytes themselves lie in the receivers'
// share rings, and the frames only say where.

#include <catch2/catch.hpp>

#include "multiproc/launch.hpp"
#include "multiproc/load_stats.hpp"
#include "test_util.hpp"

using ferry::testing::count;
using ferry::testing::data_bytes;
using ferry::testing::launch;
using ferry::testing::lines_with;
using ferry::testing::load_stats;
using ferry::testing::manifest_of;
using ferry::testing::TempDir;

namespace {

constexpr int kRanks = 4;

// Saves a replicated state; returns its checkpoint directory.
std::string save_state(const TempDir& d, const std::string& model) {
  auto saved = launch(kRanks, "--mode save --root " + d.path() + " --step 1" + model);
  INFO(saved.out);
  REQUIRE(saved.code == 0);
  auto latest = ferry::find_latest(*ferry::posix_filesystem(), d.path());
  REQUIRE(latest.ok());
  return latest->path;
}

}  // namespace

TEST_CASE("four local ranks share replicated bytes over direct lanes, rank 0 relays none",
          "[ranks][load][lanes]") {
  const std::string mode = GENERATE(std::string("shm"), std::string("tcp"));
  // The bytes themselves in the receivers' share rings, or in the frames.
  const bool in_memory = GENERATE(true, false);
  INFO("direct-lanes=" << mode << " share-memory=" << in_memory);
  TempDir d;
  // 16 MiB of replicated bytes in 1 MiB windows: many frames each way.
  const std::string model = " --seed 3 --big-mib 16";
  const ferry::Manifest m = manifest_of(save_state(d, model));
  const uint64_t one_copy = data_bytes(m);

  auto l = launch(kRanks, "--mode load --layout full --evict 1 --root " + d.path() + model +
                              " --set share-window=1MiB --set share-memory=" +
                              (in_memory ? "true" : "false") + " --set direct-lanes=" + mode);
  INFO(l.out);
  REQUIRE(l.code == 0);
  CHECK(count(l.out, "every byte equal") == kRanks);
  const auto stats = load_stats(l.out, kRanks);
  REQUIRE(stats.size() == kRanks);
  uint64_t read = 0, received = 0, disk = 0, rings = 0;
  for (const auto& [rank, s] : stats) {
    INFO("rank " << rank << " read " << s.read << " received " << s.received << " relayed "
                 << s.relayed << " in memory " << s.in_memory);
    CHECK(s.read + s.received == one_copy);
    CHECK(s.relayed == 0);
    read += s.read;
    received += s.received;
    disk += s.disk;
    rings += s.in_memory;
  }
  CHECK(read == one_copy);
  CHECK(received == (kRanks - 1) * one_copy);
  // Every shared byte went through the rings, or none did.
  CHECK(rings == (in_memory ? received : 0));
  // What the kernel saw read: one copy plus alignment, headers and readahead
  // (a few hundred KiB here), not four.
  INFO("disk bytes " << disk << ", one copy " << one_copy);
  if (disk != 0) {
    CHECK(disk >= one_copy);
    CHECK(disk <= one_copy + one_copy / 20);
  }
}

TEST_CASE("with direct lanes off rank 0 relays the shared bytes between the others",
          "[ranks][load][lanes]") {
  TempDir d;
  const std::string model = " --seed 3 --big-mib 16";
  const uint64_t one_copy = data_bytes(manifest_of(save_state(d, model)));
  auto l = launch(kRanks, "--mode load --layout full --root " + d.path() + model +
                              " --set share-window=1MiB --set direct-lanes=off");
  INFO(l.out);
  REQUIRE(l.code == 0);
  CHECK(count(l.out, "every byte equal") == kRanks);
  const auto stats = load_stats(l.out, kRanks);
  REQUIRE(stats.size() == kRanks);
  uint64_t received = 0, rings = 0;
  for (const auto& [rank, s] : stats) {
    received += s.received;
    rings += s.in_memory;
  }
  CHECK(received == (kRanks - 1) * one_copy);
  // Only where the bytes lie passes rank 0 then: they are in the rings.
  CHECK(rings == received);
  // What ranks 1..3 read for each other, and their acks, all pass rank 0.
  INFO("rank 0 relayed " << stats.at(0).relayed << " frames");
  CHECK(stats.at(0).relayed > 0);
  for (int r = 1; r < kRanks; ++r) CHECK(stats.at(r).relayed == 0);
}

TEST_CASE("a receiver that dies in a load over shm lanes releases the ranks sending to it",
          "[ranks][load][lanes]") {
  // As load_once_test's receiver death (which runs over the default tcp
  // lanes), with lanes that have no peer error handling: UCX must not abort
  // the others (rank 2 is also a sender, so it dies mid-transfer too).
  TempDir d;
  const std::string model = " --seed 9 --big-mib 32";
  save_state(d, model);
  ferry::testing::check_receiver_death_releases_senders(d.path(), model, "--set direct-lanes=shm");
}

TEST_CASE("a rank's share ring serves its next load, whose shared bytes all land anew",
          "[ranks][load][lanes]") {
  // Two checkpoints of other bytes, loaded one after the other into the same
  // tensors (filled with 0xEE in between) by the same four ranks.
  TempDir a, b;
  const std::string model = " --big-mib 16";
  save_state(a, " --seed 3" + model);
  save_state(b, " --seed 4" + model);
  auto l = launch(kRanks, "--mode load --layout full --evict 1 --root " + a.path() + " --seed 3" +
                              model + " --set share-window=1MiB --again " + b.path() +
                              " --again-seed 4");
  INFO(l.out);
  REQUIRE(l.code == 0);
  CHECK(count(l.out, "every byte equal") == 2 * kRanks);
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r);
    const std::string me = "[rank " + std::to_string(r) + "] ";
    // One ring open after each load, the same one: made once, offered twice.
    const auto rings = lines_with(l.out, me + "RINGS");
    REQUIRE(rings.size() == 2);
    CHECK_THAT(rings[0], Catch::Contains("open=1 "));
    CHECK(rings[0].substr(rings[0].find("RINGS")) == rings[1].substr(rings[1].find("RINGS")));
  }
  // Both loads passed their shared bytes through the rings.
  uint64_t in_rings[2] = {0, 0};
  for (int r = 0; r < kRanks; ++r) {
    const auto stats = lines_with(l.out, "[rank " + std::to_string(r) + "] LOADSTATS");
    REQUIRE(stats.size() == 2);
    for (int k = 0; k < 2; ++k)
      in_rings[k] += std::stoull(stats[k].substr(stats[k].find("in_memory=") + 10));
  }
  CHECK(in_rings[0] > 0);
  CHECK(in_rings[1] == in_rings[0]);
}
