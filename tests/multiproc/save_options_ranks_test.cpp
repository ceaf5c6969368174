// The file options across real ranks: each rank compresses and caps its own
// files, rank 0 commits their frames into one manifest, and other rank
// counts load it back resharded.

#include <catch2/catch.hpp>

#include "catalog.hpp"
#include "codec.hpp"
#include "launch.hpp"
#include "manifest.hpp"
#include "test_util.hpp"

using ferry::testing::launch;
using ferry::testing::TempDir;

TEST_CASE("2 ranks save compressed, capped, prefixed files, 3 ranks load them",
          "[ranks][compress]") {
  TempDir d;
  auto r = launch(2, "--mode save --root " + d.path() +
                         " --step 1 --seed 7 --set compress=zstd:1 --set shard-size=64KiB"
                         " --set filename-prefix=ck");
  INFO(r.out);
  REQUIRE(r.code == 0);
  auto fsys = ferry::posix_filesystem();
  auto latest = ferry::find_latest(*fsys, d.path());
  REQUIRE(latest.ok());
  auto m = ferry::read_manifest(*fsys, latest->path);
  REQUIRE(m.ok());
  CHECK(m->required_features == std::vector<std::string>{ferry::kCodecZstdFeature});
  bool rank1 = false;
  for (const auto& f : m->files) {
    CHECK(f.name.rfind("ck-0000", 0) == 0);
    CHECK(f.name.substr(f.name.size() - 7) == ".ferryz");
    CHECK(f.size - f.header_bytes <= 64 * 1024);
    rank1 = rank1 || f.rank == 1;
  }
  CHECK(rank1);
  for (const auto& t : m->tensors)
    for (const auto& c : t.chunks) CHECK(c.codec == "zstd");

  ferry::testing::check_loads(3, "--seed 7", d.path());
}
