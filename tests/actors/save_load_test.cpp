// End to end through the Runtime and its actors: real files, real fsyncs.

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "manifest.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::TempDir;

namespace {

std::unique_ptr<ferry::Runtime> make_runtime(
    const std::string& root, std::vector<std::pair<std::string, std::string>> kv = {}) {
  return ferry::testing::make_test_runtime(root, {std::move(kv)});
}

// A tensor that owns its bytes, filled with a pattern that depends on a seed.
struct Buf {
  std::vector<uint8_t> bytes;
  ferry::DType dtype;
  std::vector<int64_t> shape;
  Buf(ferry::DType d, std::vector<int64_t> s, uint64_t seed) : dtype(d), shape(std::move(s)) {
    int64_t n = 1;
    for (auto x : shape) n *= x;
    bytes.resize(n * ferry::dtype_size(d));
    std::mt19937_64 rng(seed);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  }
  ferry::TensorView view() { return {bytes.data(), dtype, shape}; }
};

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(offset);
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("save then load many dtypes and shapes, bytes equal", "[actors][save]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  std::vector<Buf> bufs;
  bufs.emplace_back(ferry::DType::f32, std::vector<int64_t>{300, 257}, 1);
  bufs.emplace_back(ferry::DType::bf16, std::vector<int64_t>{1000}, 2);
  bufs.emplace_back(ferry::DType::f64, std::vector<int64_t>{}, 3);     // 0-d scalar
  bufs.emplace_back(ferry::DType::i8, std::vector<int64_t>{0, 5}, 4);  // zero-size
  bufs.emplace_back(ferry::DType::i64, std::vector<int64_t>{7, 3, 5}, 5);
  bufs.emplace_back(ferry::DType::u8, std::vector<int64_t>{1}, 6);
  ferry::StateDict sd;
  for (size_t i = 0; i < bufs.size(); ++i)
    REQUIRE(sd.add("t" + std::to_string(i), bufs[i].view()).ok());

  auto h = rt->save_async(sd, 10);
  REQUIRE(h.wait_snapshot().ok());
  auto st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  CHECK(h.path() == dir.path() + "/step-00000010");
  CHECK(fs::exists(h.path() + "/MANIFEST"));
  CHECK(h.metrics().bytes > 0);
  CHECK(rt->latest() == h.path());

  std::vector<Buf> fresh;
  ferry::StateDict out;
  for (size_t i = 0; i < bufs.size(); ++i) {
    fresh.emplace_back(bufs[i].dtype, bufs[i].shape, 100 + i);
    REQUIRE(out.add("t" + std::to_string(i), fresh[i].view()).ok());
  }
  auto ls = rt->load(out, rt->latest());
  INFO(ls.to_string());
  REQUIRE(ls.ok());
  for (size_t i = 0; i < bufs.size(); ++i) CHECK(fresh[i].bytes == bufs[i].bytes);
}

TEST_CASE("a state 4x larger than the pool streams through it", "[actors][save]") {
  TempDir dir;
  auto rt = make_runtime(dir.path(), {{"pool-bytes", "1MiB"}, {"chunk-bytes", "128KiB"}});
  Buf big(ferry::DType::f32, {1024, 1024 + 17}, 7);  // ~4.07 MiB
  Buf small(ferry::DType::f16, {333}, 8);
  ferry::StateDict sd;
  REQUIRE(sd.add("big", big.view()).ok());
  REQUIRE(sd.add("small", small.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  CHECK(h.bytes_persisted() == h.bytes_total());

  Buf big2(ferry::DType::f32, {1024, 1024 + 17}, 9);
  Buf small2(ferry::DType::f16, {333}, 10);
  ferry::StateDict out;
  REQUIRE(out.add("big", big2.view()).ok());
  REQUIRE(out.add("small", small2.view()).ok());
  REQUIRE(rt->load(out, dir.path()).ok());
  CHECK(big2.bytes == big.bytes);
  CHECK(small2.bytes == small.bytes);
}

TEST_CASE("the first block, cut between the copy lanes, and checksums hashed ahead of the writes",
          "[actors][save]") {
  // The first 256 KiB block holds the header, odd-sized tensors and the
  // start of a transposed one, so the lanes' cuts fall inside tensors and
  // across a strided view. Slowed writes leave the checksums (hashed once
  // the snapshot is over, when the pool holds the whole save) done before
  // most blocks are written; a 512 KiB pool streams the save instead. A slow
  // fallocate holds the data file's creation until the snapshot has filled
  // every block it can: they wait in the serializer for the files. Load
  // verifies every checksum.
  const std::string lanes = GENERATE("1", "2", "3", "5");
  const std::string faults = GENERATE(std::string(), std::string("latency:write:5ms"),
                                      std::string("latency:truncate:30ms"));
  const std::string pool = GENERATE("4MiB", "512KiB");
  INFO("copy-threads " << lanes << ", faults '" << faults << "', pool " << pool);
  TempDir dir;
  auto fsys = ferry::filesystem_from_spec(ferry::posix_filesystem(), faults);
  REQUIRE(fsys.ok());
  auto rt = ferry::testing::make_test_runtime(
      dir.path(), {{{"copy-threads", lanes}, {"pool-bytes", pool}}, *fsys});
  Buf a(ferry::DType::f32, {37, 129}, 1);
  Buf b(ferry::DType::bf16, {1001}, 2);
  Buf c(ferry::DType::u8, {70001}, 3);
  const int64_t R = 300, C = 217;
  std::vector<int32_t> cols(R * C);  // {R, C} stored column-major
  for (size_t i = 0; i < cols.size(); ++i) cols[i] = static_cast<int32_t>(i * 2654435761u);
  Buf d(ferry::DType::f64, {513, 65}, 4);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  REQUIRE(sd.add("b", b.view()).ok());
  REQUIRE(sd.add("c", c.view()).ok());
  REQUIRE(
      sd.add("m", {cols.data(), ferry::DType::i32, {R, C}, ferry::Device::host(), {1, R}}).ok());
  REQUIRE(sd.add("d", d.view()).ok());
  auto h = rt->save_async(sd, 1);
  const ferry::Status st = h.wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());

  Buf a2(ferry::DType::f32, {37, 129}, 11);
  Buf b2(ferry::DType::bf16, {1001}, 12);
  Buf c2(ferry::DType::u8, {70001}, 13);
  std::vector<int32_t> m2(R * C, -1);
  Buf d2(ferry::DType::f64, {513, 65}, 14);
  ferry::StateDict out;
  REQUIRE(out.add("a", a2.view()).ok());
  REQUIRE(out.add("b", b2.view()).ok());
  REQUIRE(out.add("c", c2.view()).ok());
  REQUIRE(out.add("m", {m2.data(), ferry::DType::i32, {R, C}}).ok());
  REQUIRE(out.add("d", d2.view()).ok());
  const ferry::Status ls = rt->load(out, dir.path());
  INFO(ls.to_string());
  REQUIRE(ls.ok());
  CHECK(a2.bytes == a.bytes);
  CHECK(b2.bytes == b.bytes);
  CHECK(c2.bytes == c.bytes);
  CHECK(d2.bytes == d.bytes);
  bool same = true;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < C; ++k) same = same && m2[r * C + k] == cols[k * R + r];
  CHECK(same);
}

TEST_CASE("mutating after wait_snapshot does not change what was saved", "[actors][save]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf w(ferry::DType::f32, {512, 512}, 11);
  const auto original = w.bytes;
  ferry::StateDict sd;
  REQUIRE(sd.add("w", w.view()).ok());
  auto h = rt->save_async(sd, 5);
  REQUIRE(h.wait_snapshot().ok());
  std::fill(w.bytes.begin(), w.bytes.end(), 0xEE);  // the "optimizer step"
  REQUIRE(h.wait_committed().ok());

  Buf back(ferry::DType::f32, {512, 512}, 12);
  ferry::StateDict out;
  REQUIRE(out.add("w", back.view()).ok());
  REQUIRE(rt->load(out, h.path()).ok());
  CHECK(back.bytes == original);
}

TEST_CASE("load reshards: column shard, full tensor, three uneven pieces", "[actors][reshard]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  const int64_t R = 90, C = 70;
  Buf full(ferry::DType::i32, {R, C}, 13);
  ferry::StateDict sd;
  REQUIRE(sd.add("m", full.view()).ok());
  REQUIRE(rt->save_async(sd, 1).wait_committed().ok());
  auto elem = [&](int64_t r, int64_t c) {
    int32_t v;
    std::memcpy(&v, full.bytes.data() + (r * C + c) * 4, 4);
    return v;
  };

  SECTION("column shard") {
    std::vector<int32_t> col(R * 20);
    ferry::StateDict out;
    REQUIRE(
        out.add("m", {col.data(), ferry::DType::i32, {R, 20}}, ferry::Shard{{R, C}, {0, 45}}).ok());
    REQUIRE(rt->load(out, dir.path()).ok());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < 20; ++c) REQUIRE(col[r * 20 + c] == elem(r, 45 + c));
  }
  SECTION("three uneven row pieces") {
    const int64_t cuts[] = {0, 7, 61, R};
    for (int i = 0; i < 3; ++i) {
      const int64_t rows = cuts[i + 1] - cuts[i];
      std::vector<int32_t> piece(rows * C);
      ferry::StateDict out;
      REQUIRE(out.add("m", {piece.data(), ferry::DType::i32, {rows, C}},
                      ferry::Shard{{R, C}, {cuts[i], 0}})
                  .ok());
      REQUIRE(rt->load(out, dir.path()).ok());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < C; ++c) REQUIRE(piece[r * C + c] == elem(cuts[i] + r, c));
    }
  }
  SECTION("a transposed (strided) target") {
    std::vector<int32_t> t(R * C);
    // View of shape {R, C} whose memory is column-major.
    ferry::TensorView v(t.data(), ferry::DType::i32, {R, C}, ferry::Device::host(), {1, R});
    ferry::StateDict out;
    REQUIRE(out.add("m", v).ok());
    REQUIRE(rt->load(out, dir.path()).ok());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) REQUIRE(t[c * R + r] == elem(r, c));
  }
}

TEST_CASE("load errors name the key", "[actors][load]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf a(ferry::DType::f32, {4, 4}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("layer.a", a.view()).ok());
  REQUIRE(rt->save_async(sd, 1).wait_committed().ok());

  Buf wrong_shape(ferry::DType::f32, {4, 5}, 2);
  ferry::StateDict out;
  REQUIRE(out.add("layer.a", wrong_shape.view()).ok());
  auto st = rt->load(out, dir.path());
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("layer.a"));

  Buf other(ferry::DType::f32, {4, 4}, 3);
  ferry::StateDict missing;
  REQUIRE(missing.add("layer.b", other.view()).ok());
  st = rt->load(missing, dir.path());
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("layer.b"));

  ferry::StateDict nothing;
  CHECK(rt->load(nothing, dir.sub("no-such-root")).code() == ferry::StatusCode::not_found);
}

TEST_CASE("saving an existing step fails unless overwrite", "[actors][save]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf a(ferry::DType::f32, {64}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  REQUIRE(rt->save_async(sd, 3).wait_committed().ok());
  const auto first = a.bytes;

  std::fill(a.bytes.begin(), a.bytes.end(), 7);
  auto st = rt->save_async(sd, 3).wait_committed();
  CHECK(st.code() == ferry::StatusCode::already_exists);
  CHECK_THAT(st.message(), Catch::Contains("step-00000003"));
  // Nothing left behind by the refused save.
  for (auto& e : fs::directory_iterator(dir.path()))
    CHECK(e.path().filename().string().rfind(".pending-", 0) != 0);

  ferry::SaveOptions ow;
  ow.overwrite = true;
  REQUIRE(rt->save_async(sd, 3, ow).wait_committed().ok());
  Buf back(ferry::DType::f32, {64}, 2);
  ferry::StateDict out;
  REQUIRE(out.add("a", back.view()).ok());
  REQUIRE(rt->load(out, dir.path()).ok());
  CHECK(back.bytes == a.bytes);
  CHECK(back.bytes != first);
}

TEST_CASE("a second save waits for the first snapshot, or fails fast", "[actors][save]") {
  TempDir dir;
  Buf a(ferry::DType::f32, {1024, 512}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  SECTION("waits") {
    auto rt = make_runtime(dir.path());
    auto h1 = rt->save_async(sd, 1);
    auto h2 = rt->save_async(sd, 2);
    CHECK(h1.snapshot_done());  // save_async(2) returned only after it
    REQUIRE(h1.wait_committed().ok());
    REQUIRE(h2.wait_committed().ok());
    auto list = ferry::list_checkpoints(*ferry::posix_filesystem(), dir.path());
    REQUIRE(list.ok());
    REQUIRE(list->size() == 2);
    CHECK((*list)[1].commit_seq > (*list)[0].commit_seq);
  }
  SECTION("fails fast") {
    // A pool smaller than the state keeps the first snapshot open for a while.
    auto rt = make_runtime(
        dir.path(), {{"fail-fast", "true"}, {"pool-bytes", "256KiB"}, {"chunk-bytes", "128KiB"}});
    auto h1 = rt->save_async(sd, 1);
    auto h2 = rt->save_async(sd, 2);
    if (!h1.snapshot_done()) {
      CHECK(h2.wait_committed().code() == ferry::StatusCode::busy);
    }
    REQUIRE(h1.wait_committed().ok());
  }
}

TEST_CASE("a save into an unwritable place fails clearly, nothing visible", "[actors][save]") {
  TempDir dir;
  // A regular file where a directory should be: fails even for root.
  { std::ofstream(dir.sub("blocker")) << "x"; }
  auto rt = make_runtime(dir.sub("blocker") + "/ckpt");
  Buf a(ferry::DType::f32, {16}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  auto h = rt->save_async(sd, 1);
  auto st = h.wait_committed();
  CHECK_FALSE(st.ok());
  CHECK(h.wait_snapshot().code() == st.code());
  CHECK_THAT(st.message(), Catch::Contains("blocker"));
  CHECK(rt->latest().empty());
}

TEST_CASE("pending directories are never loaded", "[actors][pending]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf a(ferry::DType::f32, {32}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  // Fake an interrupted later save: a pending directory with a full copy.
  const std::string pending = dir.path() + "/" + ferry::pending_dir_name(2, "job", "abc");
  fs::copy(h.path(), pending);
  CHECK(rt->latest() == h.path());
  ferry::StateDict out;
  Buf b(ferry::DType::f32, {32}, 2);
  REQUIRE(out.add("a", b.view()).ok());
  auto st = rt->load(out, pending);
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("pending"));
}

TEST_CASE("corruption is detected and names tensor and file", "[actors][corruption]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf a(ferry::DType::f32, {256, 256}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("weights", a.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  const std::string data = h.path() + "/rank-00000-0000.safetensors";
  REQUIRE(fs::exists(data));

  Buf b(ferry::DType::f32, {256, 256}, 2);
  ferry::StateDict out;
  REQUIRE(out.add("weights", b.view()).ok());

  SECTION("a data byte") {
    flip_byte(data, fs::file_size(data) - 1000);
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("weights"));
    CHECK_THAT(st.message(), Catch::Contains("rank-00000-0000.safetensors"));
  }
  SECTION("a manifest byte") {
    flip_byte(h.path() + "/MANIFEST", 40);
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("MANIFEST"));
  }
  SECTION("a safetensors header byte") {
    flip_byte(data, 20);
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("rank-00000-0000.safetensors"));
  }
  SECTION("a truncated data file") {
    fs::resize_file(data, fs::file_size(data) - 10);
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
  }
}

// The header's check runs beside the first data reads: whatever the read
// path (plain chunks, compressed ones), a header that fails it fails the
// load. (What a failed load leaves in its targets is undefined: a read
// straight into a tensor may have landed before the check failed.)
TEST_CASE("a damaged safetensors header fails the load on every read path",
          "[actors][corruption]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Buf a(ferry::DType::f32, {512, 512}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("weights", a.view()).ok());
  const bool compressed = GENERATE(false, true);
  ferry::SaveOptions so;
  if (compressed) so.compress = "zstd:1";
  auto h = rt->save_async(sd, 1, so);
  REQUIRE(h.wait_committed().ok());
  // rank-00000-0000.safetensors, or .ferryz when compressed.
  auto m = ferry::read_manifest(*ferry::posix_filesystem(), h.path());
  REQUIRE(m.ok());
  REQUIRE(m->files.size() == 1);
  const std::string name = m->files[0].name;
  REQUIRE(m->files[0].header_bytes > 20);
  flip_byte(h.path() + "/" + name, 20);
  Buf b(ferry::DType::f32, {512, 512}, 2);
  ferry::StateDict out;
  REQUIRE(out.add("weights", b.view()).ok());
  auto st = rt->load(out, h.path());
  INFO((compressed ? "compressed: " : "plain: ") << st.to_string());
  CHECK(st.code() == ferry::StatusCode::corruption);
  CHECK_THAT(st.message(), Catch::Contains("safetensors header of file") && Catch::Contains(name));
}

TEST_CASE("2,000 small tensors round trip", "[actors][save]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  std::vector<Buf> bufs;
  ferry::StateDict sd;
  bufs.reserve(2000);
  for (int i = 0; i < 2000; ++i)
    bufs.emplace_back(ferry::DType::f32, std::vector<int64_t>{i % 37 + 1, 3}, i);
  for (int i = 0; i < 2000; ++i) REQUIRE(sd.add("p." + std::to_string(i), bufs[i].view()).ok());
  auto h = rt->save_async(sd, 1);
  CHECK(h.metrics().save_async_ms < 200);  // generous: shared CI machines
  REQUIRE(h.wait_committed().ok());
  std::vector<Buf> back;
  back.reserve(2000);
  ferry::StateDict out;
  for (int i = 0; i < 2000; ++i)
    back.emplace_back(ferry::DType::f32, std::vector<int64_t>{i % 37 + 1, 3}, i + 5000);
  for (int i = 0; i < 2000; ++i) REQUIRE(out.add("p." + std::to_string(i), back[i].view()).ok());
  REQUIRE(rt->load(out, dir.path()).ok());
  for (int i = 0; i < 2000; ++i) REQUIRE(back[i].bytes == bufs[i].bytes);
}

// 3,000 tensors of a few KiB: each staged run holds hundreds of them, read
// with one pread and each checked against its own checksum. A byte flipped
// in one tensor in the middle of a run fails the load naming that tensor,
// and a resharded load of the same tensors lands the same bytes.
TEST_CASE("many small tensors share reads: bytes equal, a flipped byte names its tensor",
          "[actors][load][corruption]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  constexpr int kTensors = 3000;
  std::vector<Buf> bufs;
  bufs.reserve(kTensors);
  ferry::StateDict sd;
  for (int i = 0; i < kTensors; ++i)
    bufs.emplace_back(ferry::DType::f32, std::vector<int64_t>{i % 7 + 2, 256}, i);
  for (int i = 0; i < kTensors; ++i) REQUIRE(sd.add("t." + std::to_string(i), bufs[i].view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());

  std::vector<Buf> back;
  back.reserve(kTensors);
  ferry::StateDict out;
  for (int i = 0; i < kTensors; ++i)
    back.emplace_back(ferry::DType::f32, std::vector<int64_t>{i % 7 + 2, 256}, i + 9000);
  for (int i = 0; i < kTensors; ++i)
    REQUIRE(out.add("t." + std::to_string(i), back[i].view()).ok());

  SECTION("whole") {
    REQUIRE(rt->load(out, h.path()).ok());
    for (int i = 0; i < kTensors; ++i) REQUIRE(back[i].bytes == bufs[i].bytes);
  }
  SECTION("resharded: the second half of every tensor's rows") {
    std::vector<Buf> half;
    half.reserve(kTensors);
    ferry::StateDict part;
    for (int i = 0; i < kTensors; ++i) {
      const int64_t rows = i % 7 + 2;
      half.emplace_back(ferry::DType::f32, std::vector<int64_t>{rows - rows / 2, 256}, i + 7000);
      REQUIRE(part.add("t." + std::to_string(i), half[i].view(),
                       ferry::Shard{{rows, 256}, {rows / 2, 0}})
                  .ok());
    }
    REQUIRE(rt->load(part, h.path()).ok());
    for (int i = 0; i < kTensors; ++i) {
      const size_t from = static_cast<size_t>((i % 7 + 2) / 2) * 256 * 4;
      REQUIRE(std::memcmp(half[i].bytes.data(), bufs[i].bytes.data() + from,
                          half[i].bytes.size()) == 0);
    }
  }
  SECTION("a flipped byte in a tensor read with its neighbours") {
    auto m = ferry::read_manifest(*ferry::posix_filesystem(), h.path());
    REQUIRE(m.ok());
    const std::string key = "t.1234";
    const ferry::ManifestTensor* t = m->find(key);
    REQUIRE(t);
    REQUIRE(t->chunks.size() == 1);
    const ferry::ManifestChunk& c = t->chunks[0];
    // Its neighbours in the file lie within the same staged run.
    REQUIRE(c.byte_length < (1u << 20));
    flip_byte(h.path() + "/" + m->files[c.file].name, c.byte_offset + c.byte_length / 2);
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("'" + key + "'"));
    CHECK_THAT(st.message(), Catch::Contains(m->files[c.file].name));
    // Tensors before it in the file passed their checks and hold their bytes.
    uint64_t before = 0;
    for (int i = 0; i < kTensors; ++i) {
      const ferry::ManifestTensor* o = m->find("t." + std::to_string(i));
      REQUIRE(o);
      if (o->chunks[0].byte_offset + o->chunks[0].byte_length <= c.byte_offset &&
          o->chunks[0].byte_offset >= c.byte_offset - std::min<uint64_t>(c.byte_offset, 65536)) {
        CHECK(back[i].bytes == bufs[i].bytes);
        ++before;
      }
    }
    CHECK(before > 2);
  }
}

TEST_CASE("bad settings are refused at start, naming the key", "[actors][config]") {
  ferry::RuntimeArgs args;
  args.set("pool-bytes", "lots");
  auto rt = ferry::Runtime::create(args);
  REQUIRE_FALSE(rt.ok());
  CHECK_THAT(rt.status().message(), Catch::Contains("pool-bytes"));
  CHECK_THAT(rt.status().message(), Catch::Contains("lots"));

  ferry::RuntimeArgs args2;
  args2.set("pool-bites", "1GiB");
  auto rt2 = ferry::Runtime::create(args2);
  REQUIRE_FALSE(rt2.ok());
  CHECK_THAT(rt2.status().message(), Catch::Contains("pool-bites"));
}

TEST_CASE("retention keeps the last N after the new one is durable", "[actors][retention]") {
  TempDir dir;
  auto rt = make_runtime(dir.path(), {{"keep-last", "2"}});
  Buf a(ferry::DType::f32, {8}, 1);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  for (uint64_t s = 1; s <= 4; ++s) REQUIRE(rt->save_async(sd, s * 10).wait_committed().ok());
  auto list = ferry::list_checkpoints(*ferry::posix_filesystem(), dir.path());
  REQUIRE(list.ok());
  REQUIRE(list->size() == 2);
  CHECK((*list)[0].step == 30);
  CHECK((*list)[1].step == 40);
}
