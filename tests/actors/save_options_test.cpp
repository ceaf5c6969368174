// The save options that shape data files, end to end through the Runtime:
// filename_prefix, shard_size and compress (real files, real loads).

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "catalog.hpp"
#include "codec.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "process.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::DType;
using ferry::testing::TempDir;

namespace {

std::unique_ptr<ferry::Runtime> make_runtime(
    const std::string& root, std::vector<std::pair<std::string, std::string>> kv = {}) {
  return ferry::testing::make_test_runtime(root, {std::move(kv)});
}

// A tensor that owns its bytes: few distinct byte values, so it compresses,
// but no long runs, so every frame holds different bytes.
struct Buf {
  std::vector<uint8_t> bytes;
  DType dtype;
  std::vector<int64_t> shape;
  Buf(DType d, std::vector<int64_t> s, uint64_t seed) : dtype(d), shape(std::move(s)) {
    int64_t n = 1;
    for (auto x : shape) n *= x;
    bytes.resize(n * ferry::dtype_size(d));
    std::mt19937_64 rng(seed);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng() % 5);
  }
  ferry::TensorView view() { return {bytes.data(), dtype, shape}; }
};

std::vector<std::string> data_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != "MANIFEST") out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

ferry::Manifest manifest_of(const std::string& dir) {
  auto fsys = ferry::posix_filesystem();
  auto m = ferry::read_manifest(*fsys, dir);
  REQUIRE(m.ok());
  return std::move(m).value();
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(offset);
  f.write(&c, 1);
}

// Loads rows [r0, r1) of a saved {R, C} tensor `key` and compares them.
void check_rows(ferry::Runtime& rt, const std::string& path, const std::string& key,
                const Buf& full, int64_t r0, int64_t r1) {
  const int64_t R = full.shape[0], C = full.shape[1];
  const size_t row = C * ferry::dtype_size(full.dtype);
  std::vector<uint8_t> piece((r1 - r0) * row, 0xee);
  ferry::StateDict out;
  REQUIRE(
      out.add(key, {piece.data(), full.dtype, {r1 - r0, C}}, ferry::Shard{{R, C}, {r0, 0}}).ok());
  auto st = rt.load(out, path);
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(std::memcmp(piece.data(), full.bytes.data() + r0 * row, piece.size()) == 0);
}

}  // namespace

TEST_CASE("compress: every dtype round trips, full and resharded", "[actors][compress]") {
  TempDir dir;
  auto rt = make_runtime(dir.path(), {{"compress", "zstd:3"}});
  const DType all[] = {DType::boolean, DType::u8,  DType::i8,  DType::i16,     DType::u16,
                       DType::i32,     DType::u32, DType::i64, DType::u64,     DType::f16,
                       DType::bf16,    DType::f32, DType::f64, DType::f8_e4m3, DType::f8_e5m2};
  std::vector<Buf> bufs;
  ferry::StateDict sd;
  for (size_t i = 0; i < std::size(all); ++i) {
    // 2.5 frames for 8-byte types: partial reads start and end mid-frame.
    bufs.emplace_back(all[i], std::vector<int64_t>{640, 512}, i + 1);
    REQUIRE(sd.add("t" + std::to_string(i), bufs.back().view()).ok());
  }
  Buf scalar(DType::f64, {}, 99), empty(DType::f32, {0, 3}, 98);
  REQUIRE(sd.add("scalar", scalar.view()).ok());
  REQUIRE(sd.add("empty", empty.view()).ok());
  auto h = rt->save_async(sd, 1);
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());

  // Compressed files are not safetensors: their own extension, the codec a
  // required feature, raw sizes kept.
  for (const auto& name : data_files(h.path()))
    CHECK((name.size() > 7 && name.substr(name.size() - 7) == ".ferryz"));
  const ferry::Manifest m = manifest_of(h.path());
  CHECK(m.required_features == std::vector<std::string>{ferry::kCodecZstdFeature});
  uint64_t raw = 0, stored = 0;
  for (const auto& t : m.tensors)
    for (const auto& c : t.chunks) {
      CHECK(c.codec == "zstd");
      raw += c.raw_bytes();
      stored += c.byte_length;
    }
  CHECK(stored * 2 < raw);  // five byte values compress well

  ferry::StateDict out;
  std::vector<Buf> fresh;
  fresh.reserve(bufs.size() + 2);
  for (size_t i = 0; i < bufs.size(); ++i) {
    fresh.emplace_back(bufs[i].dtype, bufs[i].shape, 1000 + i);
    REQUIRE(out.add("t" + std::to_string(i), fresh.back().view()).ok());
  }
  Buf scalar2(DType::f64, {}, 7), empty2(DType::f32, {0, 3}, 8);
  REQUIRE(out.add("scalar", scalar2.view()).ok());
  REQUIRE(out.add("empty", empty2.view()).ok());
  auto ls = rt->load(out, h.path());
  INFO(ls.to_string());
  REQUIRE(ls.ok());
  for (size_t i = 0; i < bufs.size(); ++i) CHECK(fresh[i].bytes == bufs[i].bytes);
  CHECK(scalar2.bytes == scalar.bytes);

  // Resharded: row ranges that start and end inside frames, and a column
  // shard that touches every frame.
  for (size_t i : {size_t{0}, size_t{10}, size_t{12}}) {
    check_rows(*rt, h.path(), "t" + std::to_string(i), bufs[i], 0, 1);
    check_rows(*rt, h.path(), "t" + std::to_string(i), bufs[i], 137, 421);
    check_rows(*rt, h.path(), "t" + std::to_string(i), bufs[i], 600, 640);
  }
  const Buf& f = bufs[11];  // f32 {640, 512}
  std::vector<float> col(640 * 3);
  ferry::StateDict cs;
  REQUIRE(
      cs.add("t11", {col.data(), DType::f32, {640, 3}}, ferry::Shard{{640, 512}, {0, 500}}).ok());
  REQUIRE(rt->load(cs, h.path()).ok());
  for (int64_t r = 0; r < 640; ++r)
    REQUIRE(std::memcmp(&col[r * 3], f.bytes.data() + (r * 512 + 500) * 4, 12) == 0);
}

TEST_CASE("compress: a damaged frame is detected and names tensor and file",
          "[actors][compress][corruption]") {
  for (const char* checksum : {"true", "false"}) {
    DYNAMIC_SECTION("checksum = " << checksum) {
      TempDir dir;
      auto rt = make_runtime(dir.path(), {{"compress", "true"}, {"checksum", checksum}});
      Buf a(DType::f32, {1024, 512}, 1);  // 2 MiB: two frames
      ferry::StateDict sd;
      REQUIRE(sd.add("weights", a.view()).ok());
      auto h = rt->save_async(sd, 1);
      REQUIRE(h.wait_committed().ok());
      const ferry::Manifest m = manifest_of(h.path());
      REQUIRE(m.tensors.size() == 1);
      const auto& c = m.tensors[0].chunks[0];
      REQUIRE(c.frame_ends.size() == 2);
      const std::string file = m.files[c.file].name;
      // In the middle of the second frame, away from the checksum block it
      // shares with the first.
      REQUIRE(c.frame_ends[1] - c.frame_ends[0] > 2 * 65536);
      flip_byte(h.path() + "/" + file, c.byte_offset + (c.frame_ends[0] + c.frame_ends[1]) / 2);

      Buf b(DType::f32, {1024, 512}, 2);
      ferry::StateDict out;
      REQUIRE(out.add("weights", b.view()).ok());
      auto st = rt->load(out, h.path());
      CHECK(st.code() == ferry::StatusCode::corruption);
      CHECK_THAT(st.message(), Catch::Contains("weights"));
      CHECK_THAT(st.message(), Catch::Contains(file));
      // The first frame alone is intact: a read of its rows succeeds.
      check_rows(*rt, h.path(), "weights", a, 0, 100);
    }
  }
}

TEST_CASE("shard_size splits a rank's data over files, and it loads back resharded",
          "[actors][shard-size]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf big(DType::f32, {200, 1000}, 1);   // 800,000 bytes: larger than the cap
  Buf small(DType::bf16, {100, 10}, 2);  // 2,000 bytes
  Buf other(DType::i64, {300, 50}, 3);   // 120,000 bytes
  ferry::StateDict sd;
  REQUIRE(sd.add("big", big.view()).ok());
  REQUIRE(sd.add("other", other.view()).ok());
  REQUIRE(sd.add("small", small.view()).ok());
  ferry::SaveOptions so;
  so.shard_size = 300000;
  so.filename_prefix = "model_v2";
  auto h = rt->save_async(sd, 1, so);
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  const auto files = data_files(h.path());
  REQUIRE(files.size() == 4);  // 922,000 bytes in files of at most 300,000
  CHECK(files[0] == "model_v2-00000-0000.safetensors");
  const ferry::Manifest m = manifest_of(h.path());
  for (const auto& f : m.files) CHECK(f.size - f.header_bytes <= 300000);
  const ferry::ManifestTensor* t = m.find("big");
  REQUIRE(t);
  CHECK(t->chunks.size() >= 3);  // split along dim 0 across files

  ferry::StateDict out;
  Buf big2(DType::f32, {200, 1000}, 9), small2(DType::bf16, {100, 10}, 8),
      other2(DType::i64, {300, 50}, 7);
  REQUIRE(out.add("big", big2.view()).ok());
  REQUIRE(out.add("small", small2.view()).ok());
  REQUIRE(out.add("other", other2.view()).ok());
  REQUIRE(rt->load(out, h.path()).ok());
  CHECK(big2.bytes == big.bytes);
  CHECK(small2.bytes == small.bytes);
  CHECK(other2.bytes == other.bytes);
  // Rows that straddle the pieces of the split item.
  check_rows(*rt, h.path(), "big", big, 30, 170);
  check_rows(*rt, h.path(), "big", big, 74, 76);
}

TEST_CASE("shard_size and compress together", "[actors][shard-size][compress]") {
  TempDir dir;
  auto rt = make_runtime(dir.path(), {{"shard-size", "1MiB"}, {"filename-prefix", "opt"}});
  Buf big(DType::bf16, {3000, 700}, 1);  // 4.2 MB raw, split before compression
  ferry::StateDict sd;
  REQUIRE(sd.add("w", big.view()).ok());
  ferry::SaveOptions so;
  so.compress = "zstd:1";
  auto h = rt->save_async(sd, 1, so);
  REQUIRE(h.wait_committed().ok());
  const auto files = data_files(h.path());
  CHECK(files.size() == 5);
  CHECK(files[0] == "opt-00000-0000.ferryz");
  check_rows(*rt, h.path(), "w", big, 0, 3000);
  check_rows(*rt, h.path(), "w", big, 700, 2300);
}

TEST_CASE("bad save options fail the save, naming the field", "[actors][config]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf a(DType::f32, {4}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  auto expect_bad = [&](const ferry::SaveOptions& so, const std::string& field) {
    auto st = rt->save_async(sd, 1, so).wait_committed();
    CHECK(st.code() == ferry::StatusCode::invalid_argument);
    CHECK_THAT(st.message(), Catch::Contains(field));
  };
  ferry::SaveOptions so;
  so.filename_prefix = "../escape";
  expect_bad(so, "SaveOptions::filename_prefix");
  so = {};
  so.filename_prefix = "";
  expect_bad(so, "SaveOptions::filename_prefix");
  so = {};
  so.shard_size = 0;
  expect_bad(so, "SaveOptions::shard_size");
  so = {};
  so.shard_size = -5;
  expect_bad(so, "SaveOptions::shard_size");
  so = {};
  so.compress = "lz4";
  expect_bad(so, "SaveOptions::compress");

  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("shard-size", "0");
  auto bad = ferry::Runtime::create(args);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("ferry.shard-size"));
}

TEST_CASE("ferry inspect and verify show a compressed checkpoint: codec, ratio, frames",
          "[actors][compress][cli]") {
  TempDir dir;
  auto rt = make_runtime(dir.path(), {{"compress", "zstd"}});
  Buf a(DType::bf16, {1536, 512}, 1);  // 1.5 MiB raw: two frames
  ferry::StateDict sd;
  REQUIRE(sd.add("layer.w", a.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  auto i = ferry::testing::run_shell(std::string(FERRY_CLI_PATH) + " inspect " + h.path());
  INFO(i.out);
  CHECK(i.code == 0);
  CHECK_THAT(i.out, Catch::Contains("codec zstd: 1.50 MiB raw"));
  CHECK_THAT(i.out, Catch::Contains("2 frames"));
  CHECK_THAT(i.out, Catch::Contains("zstd 1572864 -> "));
  CHECK_THAT(i.out, Catch::Contains("2 frames of 1.00 MiB"));
  CHECK_THAT(i.out, Catch::Contains("header ok"));
  auto v = ferry::testing::run_shell(std::string(FERRY_CLI_PATH) + " verify " + h.path());
  INFO(v.out);
  CHECK(v.code == 0);
}

TEST_CASE("compress: a strided (transposed) tensor is gathered, then compressed",
          "[actors][compress]") {
  TempDir dir;
  auto rt = make_runtime(dir.path(), {{"compress", "zstd:1"}});
  const int64_t R = 700, C = 500;
  Buf mem(DType::i32, {C, R}, 3);  // column-major storage of an {R, C} tensor
  ferry::TensorView t(mem.bytes.data(), DType::i32, {R, C}, ferry::Device::host(), {1, R});
  ferry::StateDict sd;
  REQUIRE(sd.add("t", t).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  std::vector<int32_t> back(R * C);
  ferry::StateDict out;
  REQUIRE(out.add("t", {back.data(), DType::i32, {R, C}}).ok());
  REQUIRE(rt->load(out, h.path()).ok());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      int32_t want;
      std::memcpy(&want, mem.bytes.data() + (c * R + r) * 4, 4);
      REQUIRE(back[r * C + c] == want);
    }
}
