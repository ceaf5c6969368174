// Replicated bytes are read once per node: four local ranks loading a whole
// (replicated) state read one copy from disk between them, the others get
// the bytes from the rank that read them, and every rank checks every byte.
// A reader that finds a corrupt block fails the load on every rank, naming it.
// Shared bytes are flow-controlled (share-window): however large the state,
// no rank queues more than its windows, rank 0 (which relays between ranks
// without a direct lane) included, and a receiver that dies releases the
// ranks sending to it. tests/multiproc/lanes_load_test.cpp: the same loads
// over direct lanes and without them.

#include <catch2/catch.hpp>

#include <map>
#include <sstream>

#include "catalog.hpp"
#include "load_plan.hpp"
#include "manifest.hpp"
#include "multiproc/launch.hpp"
#include "multiproc/load_stats.hpp"
#include "test_util.hpp"

using ferry::testing::count;
using ferry::testing::data_bytes;
using ferry::testing::launch;
using ferry::testing::lines_with;
using ferry::testing::LoadStats;
using ferry::testing::manifest_of;
using ferry::testing::save_latest;
using ferry::testing::TempDir;

namespace {

constexpr int kRanks = 4;

std::map<int, LoadStats> load_stats(const std::string& out) {
  return ferry::testing::load_stats(out, kRanks);
}

// The plan of a rank that loads every tensor whole, as rank_worker --layout
// full does (chunk-bytes 256 KiB caps its reads).
std::vector<ferry::ReadOp> whole_plan(const ferry::Manifest& m) {
  std::vector<ferry::LoadRequest> reqs;
  for (const auto& t : m.tensors) {
    ferry::LoadRequest r;
    r.entry = static_cast<uint32_t>(reqs.size());
    r.key = t.key;
    r.dtype = t.dtype;
    r.global_shape = t.global_shape;
    r.box = ferry::Box::whole(t.global_shape);
    reqs.push_back(r);
  }
  ferry::LoadPlanOptions o;
  o.max_read_bytes = 256 << 10;
  auto ops = ferry::make_load_plan(m, reqs, o);
  REQUIRE(ops.ok());
  return ops.value();
}

// Who reads what for whom when kRanks ranks of one node load every tensor
// whole, as rank 0 assigns it.
std::vector<ferry::SharedRead> shared_reads(const ferry::Manifest& m) {
  std::vector<ferry::RankNeeds> needs;
  const auto ops = whole_plan(m);
  for (int r = 0; r < kRanks; ++r) needs.push_back({r, "node", ferry::needed_ranges(ops, m), {}});
  return ferry::assign_shared_reads(needs);
}

}  // namespace

TEST_CASE("four local ranks loading a replicated state read it from disk once", "[ranks][load]") {
  TempDir d;
  const ferry::Manifest m = manifest_of(save_latest(kRanks, "--step 1 --seed 7", d.path()));
  const uint64_t one_copy = data_bytes(m);

  auto l = launch(kRanks, "--mode load --layout full --evict 1 --seed 7 --root " + d.path());
  INFO(l.out);
  REQUIRE(l.code == 0);
  CHECK(count(l.out, "every byte equal") == kRanks);
  const auto stats = load_stats(l.out);
  REQUIRE(stats.size() == kRanks);
  uint64_t read = 0, received = 0, disk = 0;
  for (const auto& [rank, s] : stats) {
    INFO("rank " << rank << " read " << s.read << " received " << s.received << " disk " << s.disk);
    CHECK(s.read + s.received == one_copy);  // each rank has the whole state
    read += s.read;
    received += s.received;
    disk += s.disk;
  }
  // One copy read between them, three received.
  CHECK(read == one_copy);
  CHECK(received == (kRanks - 1) * one_copy);
  // What the kernel saw read from disk: one copy plus alignment padding and
  // the safetensors headers (4 KiB each, per reading rank and file), not four.
  INFO("disk bytes " << disk << ", one copy " << one_copy << ", files " << m.files.size());
  if (disk == 0) {
    WARN("/proc/self/io read_bytes stays 0 here (no block device below the files)");
  } else {
    CHECK(disk >= one_copy);
    CHECK(disk <= one_copy + kRanks * m.files.size() * 16 * 1024 + 64 * 1024);
  }
}

TEST_CASE("a rank that reads shared bytes and finds them corrupt fails the load on every rank",
          "[ranks][load]") {
  TempDir d;
  const std::string dir = save_latest(kRanks, "--step 1 --seed 7", d.path());
  const ferry::Manifest m = manifest_of(dir);

  // A byte of the replicated "rep_big", and the rank that reads it for all.
  const ferry::ManifestTensor* t = m.find("rep_big");
  REQUIRE(t != nullptr);
  const ferry::ManifestChunk& c = t->chunks.back();
  const uint64_t bad = c.byte_offset + c.byte_length / 2;
  int reader = -1;
  for (const auto& s : shared_reads(m))
    if (s.range.file == c.file && s.range.offset <= bad && bad < s.range.offset + s.range.length) {
      CHECK(s.receivers.size() == kRanks - 1);
      reader = s.reader;
    }
  REQUIRE(reader >= 0);
  ferry::testing::flip_byte(dir + "/" + m.files[c.file].name, bad);

  auto l = launch(kRanks, "--mode load --layout full --evict 1 --seed 7 --root " + d.path());
  INFO(l.out << "\nreader of the corrupt byte: rank " << reader);
  CHECK(l.code != 0);
  CHECK(count(l.out, "every byte equal") == 0);
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r);
    const auto errors = lines_with(l.out, "[rank " + std::to_string(r) + "] ERROR load:");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains("rank " + std::to_string(reader) + ":") &&
                              Catch::Contains("checksum mismatch") && Catch::Contains("rep_big"));
  }
  CHECK(l.seconds < 20);  // the reader's failure ends the wait, not write-timeout (30 s)
}

TEST_CASE("a rank that dies while it reads shared bytes fails the load on every other rank",
          "[ranks][load]") {
  TempDir d;
  const ferry::Manifest m = manifest_of(save_latest(kRanks, "--step 1 --seed 7", d.path()));

  // A rank other than 0 (whose death ends the job anyway) that reads bytes
  // the others need.
  int reader = -1;
  for (const auto& s : shared_reads(m))
    if (s.reader > 0 && !s.receivers.empty()) reader = s.reader;
  REQUIRE(reader > 0);

  // It dies after its first read, before it sends anything on.
  auto l = launch(kRanks, "--mode load --layout full --seed 7 --root " + d.path(),
                  "FERRY_KILL_AT=load.read@" + std::to_string(reader));
  INFO(l.out << "\nkilled reader: rank " << reader);
  CHECK(l.code != 0);
  CHECK(count(l.out, "every byte equal") == 0);
  for (int r = 0; r < kRanks; ++r) {
    if (r == reader) continue;
    INFO("rank " << r);
    const auto errors = lines_with(l.out, "[rank " + std::to_string(r) + "] ERROR load:");
    REQUIRE(errors.size() == 1);
    // Named as the failed rank, by whichever report came first: the link
    // that saw it go, or rank 0's send to it.
    const std::string dead = "rank " + std::to_string(reader);
    CHECK_THAT(errors[0],
               Catch::Contains(dead + " failed") || Catch::Contains("failed peer: " + dead));
  }
  CHECK(l.seconds < 20);  // the death ends the wait (heartbeats: 3 s), not write-timeout (30 s)
}

TEST_CASE("four local ranks loading a compressed replicated state each decode it themselves",
          "[ranks][load][compress]") {
  TempDir d;
  const ferry::Manifest m =
      manifest_of(save_latest(kRanks, "--step 1 --seed 11 --set compress=zstd", d.path()));
  bool compressed = false;
  for (const auto& t : m.tensors)
    for (const auto& c : t.chunks) compressed |= !c.codec.empty();
  REQUIRE(compressed);

  // Shared bytes would be frames, not values: every rank reads its own.
  auto l = launch(kRanks, "--mode load --layout full --seed 11 --root " + d.path());
  INFO(l.out);
  REQUIRE(l.code == 0);
  CHECK(count(l.out, "every byte equal") == kRanks);
  for (const auto& [rank, s] : load_stats(l.out)) {
    INFO("rank " << rank);
    CHECK(s.received == 0);
  }
}

TEST_CASE(
    "a replicated state many times the share window loads with every queue within the windows",
    "[ranks][load][flow]") {
  // 64 MiB of replicated bytes, a 1 MiB window: each rank reads a quarter and
  // sends it to three others, 48 windows' worth per receiver.
  constexpr uint64_t kWindow = 1 << 20;
  constexpr int kBigMiB = 64;
  TempDir d;
  const std::string model = " --seed 5 --big-mib " + std::to_string(kBigMiB);
  const uint64_t one_copy =
      data_bytes(manifest_of(save_latest(kRanks, "--step 1" + model, d.path())));
  REQUIRE(one_copy > 32 * kWindow);

  auto l = launch(kRanks, "--mode load --layout full --root " + d.path() + model +
                              " --set share-window=" + std::to_string(kWindow));
  INFO(l.out);
  REQUIRE(l.code == 0);
  CHECK(count(l.out, "every byte equal") == kRanks);
  const auto stats = load_stats(l.out);
  REQUIRE(stats.size() == kRanks);
  // Frames carry a little more than their data (header, Cap'n Proto); acks
  // are a hundred bytes each.
  constexpr uint64_t kSlack = 1 << 20;
  for (const auto& [rank, s] : stats) {
    INFO("rank " << rank << " queued at most " << s.queued << " bytes, VmHWM grew "
                 << s.hwm_growth);
    CHECK(s.read + s.received == one_copy);
    CHECK(s.received >= (kRanks - 2) * one_copy / kRanks);
    // Rank 0 sends its own reads to three ranks and passes on what the other
    // three send each other (windows into ranks 1..3 from every other rank);
    // a rank > 0 sends only its own reads, to three ranks.
    const uint64_t windows = rank == 0 ? (kRanks - 1) * (kRanks - 1) : kRanks - 1;
    CHECK(s.queued > 0);
    CHECK(s.queued <= windows * kWindow + kSlack);
  }
  // Memory, as the kernel sees it: rank 0 holds at most the windows passing
  // through it, in and out, a few copies each, plus fixed costs (threads,
  // buffers); not the state (64 MiB), which it would hold several times over
  // without flow control.
  // Not under AddressSanitizer, whose quarantine keeps freed memory
  // resident (the queue bounds above still hold there).
#ifndef __SANITIZE_ADDRESS__
  const uint64_t bound = 4 * (kRanks - 1) * (kRanks - 1) * kWindow + (24 << 20);
  INFO("rank 0 VmHWM growth " << stats.at(0).hwm_growth << ", bound " << bound);
  CHECK(stats.at(0).hwm_growth < bound);
#endif
}

TEST_CASE("a receiver that dies in a flow-controlled load releases the ranks sending to it",
          "[ranks][load][flow]") {
  TempDir d;
  const std::string model = " --seed 9 --big-mib 32";
  auto saved = launch(kRanks, "--mode save --root " + d.path() + " --step 1" + model);
  INFO(saved.out);
  REQUIRE(saved.code == 0);

  // Over the default (tcp) direct lanes.
  ferry::testing::check_receiver_death_releases_senders(d.path(), model);
}
