// The public catalog (ferry/catalog.hpp) on checkpoints the runtime saved:
// the manifest's tensor list is what was saved, and verify names the file
// a damaged byte is in.
#include "ferry/catalog.hpp"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "ferry/runtime.hpp"
#include "test_util.hpp"

namespace {

using ferry::testing::TempDir;

struct Saved {
  std::vector<float> weight;
  std::vector<int64_t> steps;
};

// Steps 100 and 200 of two tensors, the weight in several chunks.
void save_two(const TempDir& dir, Saved* s) {
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  s->weight.assign(50000, 1.5f);
  s->steps = {7};
  ferry::StateDict sd;
  REQUIRE(sd.add("encoder.weight", {s->weight.data(), ferry::DType::f32, {500, 100}}).ok());
  REQUIRE(sd.add("step", {s->steps.data(), ferry::DType::i64, {1}}).ok());
  REQUIRE((*rt)->save_async(sd, 100).wait_committed().ok());
  REQUIRE((*rt)->save_async(sd, 200).wait_committed().ok());
}

}  // namespace

TEST_CASE("public catalog: a manifest's tensor list is what was saved", "[catalog][public]") {
  TempDir dir;
  Saved s;
  save_two(dir, &s);
  const ferry::Catalog catalog;
  auto m = catalog.manifest(dir.path());  // a root: its latest
  REQUIRE(m.ok());
  CHECK(m->path == dir.path() + "/step-00000200");
  CHECK(m->step == 200);
  CHECK(m->coverage.ok());
  REQUIRE(m->tensors.size() == 2);
  const ferry::ManifestTensorInfo& w = m->tensors[0];
  CHECK(w.key == "encoder.weight");
  CHECK(w.dtype == ferry::DType::f32);
  CHECK(w.global_shape == std::vector<int64_t>{500, 100});
  CHECK(w.bytes == 50000 * sizeof(float));
  CHECK(w.raw_bytes == w.bytes);
  uint64_t chunk_bytes = 0;
  for (const auto& c : w.chunks) {
    chunk_bytes += c.byte_length;
    CHECK(c.file < m->files.size());
    CHECK_FALSE(c.checksums.empty());
  }
  CHECK(chunk_bytes == w.bytes);
  const ferry::ManifestTensorInfo& step = m->tensors[1];
  CHECK(step.key == "step");
  CHECK(step.dtype == ferry::DType::i64);
  CHECK(step.global_shape == std::vector<int64_t>{1});
  CHECK(step.bytes == 8);
  CHECK(m->bytes == w.bytes + step.bytes);

  auto checked = catalog.manifest(m->path, ferry::ManifestOptions{/*check_headers=*/true});
  REQUIRE(checked.ok());
  for (const auto& f : checked->files) CHECK(f.header.ok());
}

TEST_CASE("public catalog: verify names the damaged file, latest_valid walks back past it",
          "[catalog][public]") {
  TempDir dir;
  Saved s;
  save_two(dir, &s);
  const ferry::Catalog catalog;
  auto good = catalog.verify(dir.path());
  REQUIRE(good.ok());
  CHECK(good->ok());
  CHECK(std::string(good->verdict()) == "OK");

  auto m = catalog.manifest(dir.path());
  REQUIRE(m.ok());
  const ferry::ManifestChunkInfo& c = m->tensors[0].chunks.back();
  const std::string damaged = m->files[c.file].name;
  ferry::testing::flip_byte(m->path + "/" + damaged, c.byte_offset + c.byte_length / 2);
  auto bad = catalog.verify(m->path);
  REQUIRE(bad.ok());
  REQUIRE_FALSE(bad->ok());
  CHECK(std::string(bad->verdict()) == "CORRUPT");
  bool named = false;
  for (const auto& p : bad->problems)
    named = named || p.message().find(damaged) != std::string::npos;
  CHECK(named);

  auto latest = catalog.latest(dir.path());
  REQUIRE(latest.ok());
  CHECK(latest->step == 200);  // its manifest reads: still the latest
  auto valid = catalog.latest_valid(dir.path());
  REQUIRE(valid.ok());
  CHECK(valid->step == 100);
}
