// A multi-rank load ends the same way on every rank: a corrupt block that
// only one rank reads fails the load everywhere, naming that rank, the tensor
// and the file.

#include <catch2/catch.hpp>

#include <filesystem>

#include "catalog.hpp"
#include "manifest.hpp"
#include "multiproc/launch.hpp"
#include "test_util.hpp"

using ferry::testing::check_loads;
using ferry::testing::count;
using ferry::testing::flip_byte;
using ferry::testing::launch;
using ferry::testing::lines_with;
using ferry::testing::save_latest;
using ferry::testing::TempDir;

namespace {

// Where rank 1's rows of `key` (row-split by rank_worker, rows [32, 96) of 96
// with 2 ranks) lie on disk: the file name and the chunk's first byte.
std::pair<std::string, uint64_t> rank1_rows(const std::string& step_dir, const std::string& key) {
  auto m = ferry::read_manifest(*ferry::posix_filesystem(), step_dir);
  REQUIRE(m.ok());
  const ferry::ManifestTensor* t = m->find(key);
  REQUIRE(t != nullptr);
  for (const auto& c : t->chunks)
    if (!c.offsets.empty() && c.offsets[0] == 32) return {m->files[c.file].name, c.byte_offset};
  FAIL("no chunk of " << key << " starts at row 32");
  return {};
}

}  // namespace

TEST_CASE("a checksum mismatch on one rank fails the load on every rank, naming it",
          "[ranks][load]") {
  TempDir d;
  const std::string dir = save_latest(2, "--step 1 --seed 7", d.path());
  const std::string key = "layers.0.w_row";
  const auto [file, offset] = rank1_rows(dir, key);
  flip_byte(dir + "/" + file, offset + 100);

  // The saved sharding: rank 0 reads rows [0, 32) only, which are intact.
  auto l = launch(2, "--mode load --layout save --seed 7 --root " + d.path());
  INFO(l.out);
  CHECK(l.code != 0);
  CHECK(count(l.out, "every byte equal") == 0);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    const auto errors = lines_with(l.out, "[rank " + std::to_string(rank) + "] ERROR load:");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains("rank 1:") && Catch::Contains(key) &&
                              Catch::Contains(file) && Catch::Contains("checksum mismatch"));
  }
}

TEST_CASE("a rank that dies before its load fails the load on the others, naming it",
          "[ranks][load]") {
  TempDir d;
  auto saved = launch(2, "--mode save --root " + d.path() + " --step 1 --seed 7");
  INFO(saved.out);
  REQUIRE(saved.code == 0);
  auto l = launch(2, "--mode load --seed 7 --kill-rank 1 --kill-after load --root " + d.path());
  INFO(l.out);
  CHECK(l.code != 0);
  CHECK(count(l.out, "every byte equal") == 0);
  const auto errors = lines_with(l.out, "[rank 0] ERROR load:");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("rank 1"));
  CHECK(l.seconds < 15);  // the failure ends the wait, not write-timeout (30 s)
}

TEST_CASE("a data file missing on one rank fails the load on every rank, naming the file",
          "[ranks][load][files]") {
  TempDir d;
  const std::string dir = save_latest(2, "--step 1 --seed 7", d.path());
  const std::string file = dir + "/rank-00001-0000.safetensors";
  REQUIRE(std::filesystem::remove(file));

  auto l = launch(2, "--mode load --layout save --seed 7 --root " + d.path());
  INFO(l.out);
  CHECK(l.code != 0);
  CHECK(count(l.out, "every byte equal") == 0);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    const auto errors = lines_with(l.out, "[rank " + std::to_string(rank) + "] ERROR load:");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains(file) && Catch::Contains("No such file or directory"));
  }
}

TEST_CASE("ranks that load different checkpoints are refused at once, naming ranks and paths",
          "[ranks][load]") {
  TempDir d;
  const std::string one = save_latest(2, "--step 1 --seed 7", d.path());
  const std::string two = save_latest(2, "--step 2 --seed 8", d.path());
  REQUIRE(one != two);

  // Rank 1 names step 2, rank 0 step 1: neither may load the other's step.
  auto l = launch(2, "--mode load --seed 7 --root " + one + " --root-for-rank 1=" + two);
  INFO(l.out);
  CHECK(l.code != 0);
  CHECK(count(l.out, "every byte equal") == 0);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    const auto errors = lines_with(l.out, "[rank " + std::to_string(rank) + "] ERROR load:");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::Contains("disagree") && Catch::Contains("rank 0") &&
                              Catch::Contains("rank 1") && Catch::Contains(one) &&
                              Catch::Contains(two));
  }

  // The same checkpoint spelled two ways (the root, its latest step) is one.
  check_loads(2, "--seed 8 --root-for-rank 1=" + two, d.path());
}
