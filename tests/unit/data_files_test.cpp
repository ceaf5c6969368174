// The data files of a save (data_files.hpp): the options resolved once, the
// files a rank's SavePlan names are the files data_files() gives its writers,
// and the manifest rank 0 commits is checked against itself first.

#include <catch2/catch.hpp>

#include <map>
#include <set>

#include "codec.hpp"
#include "data_files.hpp"
#include "manifest_check.hpp"
#include "planner_api.hpp"

using namespace ferry;

namespace {

// Rank r of `world`: a row shard of a large tensor, a tensor every rank
// holds alike (replicated), and a small one of its own.
LocalPlan rank_plan(int32_t r, int32_t world, std::vector<std::vector<float>>& keep) {
  StateDict sd;
  const int64_t rows = 96;
  const int64_t mine = rows / world + (r < rows % world ? 1 : 0);
  keep.emplace_back(static_cast<size_t>(mine * 512));
  REQUIRE(sd.add("shard.w", TensorView(keep.back().data(), DType::f32, {mine, 512}),
                 Shard{{rows, 512}, {r * (rows / world) + std::min<int64_t>(r, rows % world), 0}})
              .ok());
  keep.emplace_back(200 * 300);
  REQUIRE(sd.add("rep.w", TensorView(keep.back().data(), DType::f32, {200, 300})).ok());
  keep.emplace_back(8);
  REQUIRE(sd.add("own." + std::to_string(r), TensorView(keep.back().data(), DType::f32, {8})).ok());
  auto p = make_local_plan(sd, r);
  REQUIRE(p.ok());
  return std::move(p).value();
}

}  // namespace

TEST_CASE("file options resolve once: the configuration fills what a save leaves unset",
          "[data_files]") {
  Options cfg;
  cfg.filename_prefix = "cfg";
  cfg.shard_size = 1 << 20;
  cfg.compress = "zstd:3";
  auto d = resolve_data_files(cfg, SaveOptions{}, false);
  REQUIRE(d.ok());
  CHECK(*d == DataFileOptions{"cfg", 1 << 20, "zstd:3"});
  CHECK(d->extension() == kCompressedExtension);
  SaveOptions o;
  o.filename_prefix = "model_v3";
  o.shard_size = 4096;
  o.compress = "true";
  CHECK(*resolve_data_files(cfg, o, false) == DataFileOptions{"model_v3", 4096, "zstd:3"});
  // A checkpoint_fn writes plain safetensors: nothing is compressed.
  auto custom = resolve_data_files(cfg, o, true);
  CHECK(custom->compress == "none");
  CHECK(custom->extension() == "safetensors");
  o.shard_size = 0;
  CHECK_THAT(resolve_data_files(cfg, o, false).status().message(),
             Catch::Contains("SaveOptions::shard_size = 0"));
  o.shard_size = 4096;
  o.filename_prefix = "a/b";
  CHECK_THAT(resolve_data_files(cfg, o, false).status().message(),
             Catch::Contains("SaveOptions::filename_prefix"));
}

TEST_CASE("each rank's SavePlan names exactly the files data_files() gives its writers",
          "[data_files]") {
  for (int32_t world : {1, 2, 3})
    for (const char* prefix : {"rank", "model_v3"})
      for (uint64_t cap : {uint64_t{0}, uint64_t{1} << 16, uint64_t{100000}})
        for (const char* compress : {"none", "zstd:3"}) {
          INFO(world << " ranks, prefix " << prefix << ", cap " << cap << ", " << compress);
          std::vector<std::vector<float>> keep;
          std::vector<LocalPlan> locals;
          for (int32_t r = 0; r < world; ++r) locals.push_back(rank_plan(r, world, keep));
          auto gp = make_global_plan(locals);
          REQUIRE(gp.ok());
          std::vector<DataFileOptions> fo(world, DataFileOptions{prefix, cap, compress});
          auto plans = save_plans(locals, *gp, fo);
          REQUIRE(plans.ok());
          uint64_t total = 0;
          for (int32_t r = 0; r < world; ++r) {
            const SavePlan& sp = (*plans)[r];
            auto files = data_files(locals[r], gp->ranks[r], fo[r]);
            REQUIRE(files.ok());
            // The same files, each holding the same pieces in the same order.
            REQUIRE(sp.files.size() == files->size());
            size_t w = 0;
            for (size_t f = 0; f < files->size(); ++f) {
              const PlannedFile& pf = (*files)[f];
              CHECK(sp.files[f] == pf.name);
              CHECK(pf.name.rfind(std::string(prefix) + "-0000" + std::to_string(r) + "-", 0) == 0);
              CHECK_THAT(pf.name, Catch::EndsWith(compress == std::string("none") ? ".safetensors"
                                                                                  : ".ferryz"));
              CHECK_THAT(sp.to_string(), Catch::Contains("-> " + pf.name));
              uint64_t stored = 0;
              for (const FileSlice& s : pf.slices) {
                REQUIRE(w < sp.writes.size());
                CHECK(sp.writes[w].file == f);
                CHECK(sp.writes[w].item == s.item);
                CHECK(sp.writes[w].offsets == s.box.offsets);
                CHECK(sp.writes[w].sizes == s.box.sizes);
                stored += compress == std::string("none") ? sp.writes[w].nbytes
                                                          : max_stored_bytes(sp.writes[w].nbytes);
                ++w;
              }
              // Within the cap, unless one row alone is larger.
              if (cap > 0 && pf.slices.size() > 1) CHECK(stored <= cap);
            }
            CHECK(w == sp.writes.size());
            total += sp.bytes;
          }
          // Every region written once: the shards, one copy of the replica.
          CHECK(total == (96 * 512 + 200 * 300 + 8 * static_cast<uint64_t>(world)) * 4);
          if (cap == (1u << 16)) CHECK((*plans)[0].files.size() > 2);
        }
}

namespace {

Manifest one_chunk_manifest() {
  Manifest m;
  m.checksum_block_bytes = 1 << 16;
  m.files.push_back({"rank-00000-0000.ferryz", 4096 + 1000, 0, 4096, 0});
  ManifestTensor t;
  t.key = "model.big.weight";
  t.dtype = DType::f32;
  t.global_shape = {256, 1024};
  ManifestChunk c;
  c.offsets = {0, 0};
  c.sizes = {256, 1024};
  c.file = 0;
  c.byte_offset = 4096;
  c.byte_length = 1000;
  c.entry = "model.big.weight@0,0";
  c.codec = kCodecZstd;
  c.raw_length = 256 * 1024 * 4;
  c.frame_bytes = kFrameRawBytes;
  c.frame_ends = {1000};
  t.chunks.push_back(c);
  m.tensors.push_back(t);
  m.required_features.push_back(kCodecZstdFeature);
  return m;
}

}  // namespace

TEST_CASE("a manifest that would not load is refused before the commit, naming tensor and file",
          "[data_files][manifest]") {
  Manifest m = one_chunk_manifest();
  CHECK(check_manifest_before_commit(m).ok());
  SECTION("stored length and frames disagree (a custom writer's raw file)") {
    m.tensors[0].chunks[0].byte_length = 900;
    const std::string e = check_manifest_before_commit(m).message();
    CHECK_THAT(e, Catch::Contains("'model.big.weight'") &&
                      Catch::Contains("'rank-00000-0000.ferryz'") &&
                      Catch::Contains("frames end at 1000, the stored length is 900"));
  }
  SECTION("a raw chunk whose stored length is not its size") {
    auto& c = m.tensors[0].chunks[0];
    c.codec.clear();
    c.frame_ends.clear();
    CHECK_THAT(check_manifest_before_commit(m).message(),
               Catch::Contains("stored length 1000") && Catch::Contains("rank-00000-0000"));
  }
  SECTION("bytes past the end of the file, or inside its header") {
    m.files[0].size = 4096 + 999;
    CHECK_THAT(check_manifest_before_commit(m).message(),
               Catch::Contains("not inside the data of the file") &&
                   Catch::Contains("'rank-00000-0000.ferryz'"));
    m = one_chunk_manifest();
    m.tensors[0].chunks[0].byte_offset = 100;
    CHECK_THAT(check_manifest_before_commit(m).message(),
               Catch::Contains("not inside the data of the file"));
  }
  SECTION("what only the load's own check sees: a file listed twice") {
    m.files.push_back(m.files[0]);
    CHECK_THAT(check_manifest_before_commit(m).message(),
               Catch::Contains("would not load") && Catch::Contains("listed twice"));
  }
}
