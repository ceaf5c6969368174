#include "load_plan.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "checksum.hpp"

using ferry::Box;
using ferry::DType;

namespace {

// The byte every saved element holds, from its global linear index: distinct
// enough that a misplaced element or a swapped byte shows.
uint8_t pattern(uint32_t seed, int64_t global_elem, size_t byte) {
  uint64_t x = (static_cast<uint64_t>(global_elem) + 1) * 0x9E3779B97F4A7C15ull + seed * 131 + byte;
  x ^= x >> 29;
  return static_cast<uint8_t>(x * 0xBF58476D1CE4E5B9ull >> 56);
}

int64_t global_linear(const std::vector<int64_t>& shape, const std::vector<int64_t>& coord) {
  int64_t g = 0;
  for (size_t k = 0; k < shape.size(); ++k) g = g * shape[k] + coord[k];
  return g;
}

// Calls fn(global coordinates, local row-major index) for every element of box.
template <class F>
void for_each_elem(const Box& box, F fn) {
  if (box.empty()) return;
  std::vector<int64_t> idx(box.rank(), 0), coord(box.offsets);
  for (int64_t local = 0;; ++local) {
    fn(coord, local);
    size_t k = box.rank();
    bool wrapped = true;
    while (k > 0) {
      --k;
      if (++idx[k] < box.sizes[k]) {
        ++coord[k];
        wrapped = false;
        break;
      }
      idx[k] = 0;
      coord[k] = box.offsets[k];
    }
    if (wrapped) return;
  }
}

// Boxes of a grid tiling: cuts[k] are the interior cut points of dim k.
std::vector<Box> grid(const std::vector<int64_t>& shape,
                      const std::vector<std::vector<int64_t>>& cuts) {
  std::vector<Box> out{Box{}};
  for (size_t k = 0; k < shape.size(); ++k) {
    std::vector<int64_t> pts{0};
    for (int64_t c : cuts[k]) pts.push_back(c);
    pts.push_back(shape[k]);
    std::vector<Box> next;
    for (const auto& b : out) {
      for (size_t i = 0; i + 1 < pts.size(); ++i) {
        Box nb = b;
        nb.offsets.push_back(pts[i]);
        nb.sizes.push_back(pts[i + 1] - pts[i]);
        next.push_back(nb);
      }
    }
    out = std::move(next);
  }
  return out;
}

// A checkpoint held in memory: the manifest and the bytes of its data files,
// laid out as a writer would (chunks back to back, with gaps so offsets are
// not aligned), with a checksum per block.
class MemCheckpoint {
 public:
  explicit MemCheckpoint(uint64_t block_bytes, size_t nfiles = 2) : files_(nfiles) {
    m_.checksum_block_bytes = block_bytes;
    for (size_t i = 0; i < nfiles; ++i) m_.files.push_back({"rank-" + std::to_string(i), 0, 0});
  }

  void add(const std::string& key, DType dtype, const std::vector<int64_t>& shape,
           const std::vector<Box>& chunks) {
    ferry::ManifestTensor t;
    t.key = key;
    t.dtype = dtype;
    t.global_shape = shape;
    const uint32_t seed = seed_of(key);
    const size_t es = ferry::dtype_size(dtype);
    for (const auto& b : chunks) {
      ferry::ManifestChunk c;
      c.offsets = b.offsets;
      c.sizes = b.sizes;
      c.file = static_cast<uint32_t>(next_file_++ % files_.size());
      auto& f = files_[c.file];
      f.resize(f.size() + 7, 0xEE);  // a gap between chunks
      c.byte_offset = f.size();
      c.byte_length = static_cast<uint64_t>(b.numel()) * es;
      f.resize(f.size() + c.byte_length);
      for_each_elem(b, [&](const std::vector<int64_t>& coord, int64_t local) {
        const int64_t g = global_linear(shape, coord);
        for (size_t j = 0; j < es; ++j) f[c.byte_offset + local * es + j] = pattern(seed, g, j);
      });
      for (uint64_t off = 0; off < c.byte_length; off += m_.checksum_block_bytes) {
        const uint64_t n = std::min(m_.checksum_block_bytes, c.byte_length - off);
        c.checksums.push_back(ferry::xxh3_64(f.data() + c.byte_offset + off, n));
      }
      c.entry = key + "@" + b.to_string();
      t.chunks.push_back(std::move(c));
    }
    // Manifest::find needs the tensors sorted by key.
    auto at = std::lower_bound(m_.tensors.begin(), m_.tensors.end(), t.key,
                               [](const auto& a, const std::string& k) { return a.key < k; });
    m_.tensors.insert(at, std::move(t));
  }

  const ferry::Manifest& manifest() const { return m_; }
  const std::vector<uint8_t>& file(size_t i) const { return files_[i]; }
  static uint32_t seed_of(const std::string& key) {
    return static_cast<uint32_t>(std::hash<std::string>{}(key));
  }

 private:
  ferry::Manifest m_;
  std::vector<std::vector<uint8_t>> files_;
  size_t next_file_ = 0;
};

// The caller's side: owned buffers, each a shard of one saved tensor.
struct Target {
  std::string key;
  DType dtype;
  std::vector<int64_t> global_shape;
  Box box;
  std::vector<uint8_t> bytes;
};

struct LoadStats {
  uint64_t bytes_read = 0;
  size_t reads = 0;
};

// Executes a plan against the in-memory files the way a loader would: read,
// verify every block read, copy out. Checks that each target byte is written
// exactly once and holds the saved value.
LoadStats load_and_check(const MemCheckpoint& ck, std::vector<Target>& targets,
                         ferry::LoadPlanOptions opts = {}) {
  // Pieces of one tensor are the shards of different ranks: one state dict
  // each, planned together as one loader would for several requests.
  std::vector<ferry::LoadRequest> reqs;
  for (size_t i = 0; i < targets.size(); ++i) {
    auto& t = targets[i];
    t.bytes.assign(static_cast<size_t>(t.box.numel()) * ferry::dtype_size(t.dtype), 0);
    ferry::StateDict sd;
    REQUIRE(sd.add(t.key, ferry::TensorView{t.bytes.data(), t.dtype, t.box.sizes},
                   ferry::Shard{t.global_shape, t.box.offsets})
                .ok());
    auto r = ferry::make_load_requests(sd);
    REQUIRE(r.ok());
    REQUIRE(r->size() == 1);
    reqs.push_back(r->front());
    reqs.back().entry = static_cast<uint32_t>(i);
  }
  auto plan = ferry::make_load_plan(ck.manifest(), reqs, opts);
  INFO(plan.status().to_string());
  REQUIRE(plan.ok());

  const auto& m = ck.manifest();
  std::vector<std::vector<int>> writes(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) writes[i].assign(targets[i].bytes.size(), 0);

  LoadStats stats;
  for (const auto& op : *plan) {
    const auto& tensor = m.tensors.at(op.tensor);
    const auto& chunk = tensor.chunks.at(op.chunk);
    REQUIRE(op.file == chunk.file);
    REQUIRE(op.file_offset == chunk.byte_offset + op.chunk_offset);
    REQUIRE(op.chunk_offset == uint64_t{op.first_block} * m.checksum_block_bytes);
    REQUIRE(op.chunk_offset + op.length <= chunk.byte_length);
    REQUIRE(op.length <= std::max(opts.max_read_bytes, m.checksum_block_bytes));
    const auto& f = ck.file(op.file);
    REQUIRE(op.file_offset + op.length <= f.size());
    std::vector<uint8_t> buf(f.begin() + op.file_offset, f.begin() + op.file_offset + op.length);
    stats.bytes_read += op.length;
    ++stats.reads;

    // Whole blocks only, each verified.
    uint64_t covered = 0;
    for (uint32_t b = 0; b < op.nblocks; ++b) {
      const uint64_t start = uint64_t{op.first_block + b} * m.checksum_block_bytes;
      const uint64_t n = std::min(m.checksum_block_bytes, chunk.byte_length - start);
      REQUIRE(start - op.chunk_offset + n <= buf.size());
      CHECK(ferry::xxh3_64(buf.data() + (start - op.chunk_offset), n) ==
            chunk.checksums.at(op.first_block + b));
      covered += n;
    }
    REQUIRE(covered == op.length);

    auto& t = targets.at(op.entry);
    const size_t es = ferry::dtype_size(t.dtype);
    ferry::for_each_copy(op, es, [&](uint64_t src, uint64_t dst, uint64_t n) {
      REQUIRE(n > 0);
      REQUIRE(src + n <= buf.size());
      REQUIRE(dst + n <= t.bytes.size());
      std::memcpy(t.bytes.data() + dst, buf.data() + src, n);
      for (uint64_t j = 0; j < n; ++j) ++writes[op.entry][dst + j];
    });
  }

  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    INFO("target " << t.key << " " << t.box.to_string());
    CHECK(std::all_of(writes[i].begin(), writes[i].end(), [](int w) { return w == 1; }));
    const uint32_t seed = MemCheckpoint::seed_of(t.key);
    const size_t es = ferry::dtype_size(t.dtype);
    size_t bad = 0;
    for_each_elem(t.box, [&](const std::vector<int64_t>& coord, int64_t local) {
      const int64_t g = global_linear(t.global_shape, coord);
      for (size_t j = 0; j < es; ++j)
        if (t.bytes[local * es + j] != pattern(seed, g, j)) ++bad;
    });
    CHECK(bad == 0);
  }
  return stats;
}

std::vector<Target> targets_for(const std::string& key, DType dtype,
                                const std::vector<int64_t>& shape, const std::vector<Box>& boxes) {
  std::vector<Target> out;
  for (size_t i = 0; i < boxes.size(); ++i) out.push_back({key, dtype, shape, boxes[i], {}});
  return out;
}

ferry::Result<std::vector<ferry::ReadOp>> plan_for(const MemCheckpoint& ck, const std::string& key,
                                                   DType dtype, const std::vector<int64_t>& shape,
                                                   const Box& box) {
  ferry::LoadRequest r;
  r.key = key;
  r.dtype = dtype;
  r.global_shape = shape;
  r.box = box;
  return ferry::make_load_plan(ck.manifest(), {r});
}

}  // namespace

TEST_CASE("make_load_requests: whole tensors and shards", "[load_plan]") {
  std::vector<float> a(6), b(4);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", ferry::TensorView{a.data(), DType::f32, {2, 3}}).ok());
  REQUIRE(sd.add("b", ferry::TensorView{b.data(), DType::f32, {2, 2}}, ferry::Shard{{4, 2}, {2, 0}})
              .ok());
  auto reqs = ferry::make_load_requests(sd);
  REQUIRE(reqs.ok());
  REQUIRE(reqs->size() == 2);
  CHECK((*reqs)[0].entry == 0);
  CHECK((*reqs)[0].key == "a");
  CHECK((*reqs)[0].global_shape == std::vector<int64_t>{2, 3});
  CHECK((*reqs)[0].box == Box{{0, 0}, {2, 3}});
  CHECK((*reqs)[1].entry == 1);
  CHECK((*reqs)[1].global_shape == std::vector<int64_t>{4, 2});
  CHECK((*reqs)[1].box == Box{{2, 0}, {2, 2}});

  ferry::StateDict bad;
  REQUIRE(
      bad.add("oops", ferry::TensorView{b.data(), DType::f32, {2, 2}}, ferry::Shard{{3, 2}, {2, 0}})
          .ok());
  auto r = ferry::make_load_requests(bad);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ferry::StatusCode::invalid_argument);
  CHECK_THAT(r.status().message(), Catch::Contains("oops"));
}

TEST_CASE("1-D tensor saved row-sharded, loaded any way", "[load_plan]") {
  const std::vector<int64_t> shape{1000};
  MemCheckpoint ck(256);
  ck.add("v", DType::f32, shape, grid(shape, {{250, 500, 750}}));

  SECTION("whole") {
    auto t = targets_for("v", DType::f32, shape, {Box::whole(shape)});
    auto st = load_and_check(ck, t);
    CHECK(st.bytes_read == 4000);
  }
  SECTION("three uneven pieces") {
    auto t = targets_for("v", DType::f32, shape, grid(shape, {{1, 613}}));
    load_and_check(ck, t);
  }
  SECTION("a piece inside one chunk reads only its blocks") {
    auto t = targets_for("v", DType::f32, shape, {Box{{300}, {10}}});
    auto st = load_and_check(ck, t);
    CHECK(st.bytes_read == 256);  // elements 300..309 sit in the chunk's first block
  }
}

TEST_CASE("2-D tensor saved row-sharded, resharded on load", "[load_plan]") {
  const std::vector<int64_t> shape{12, 10};
  for (DType dt : {DType::u8, DType::bf16, DType::f32, DType::f64}) {
    DYNAMIC_SECTION("dtype " << ferry::dtype_name(dt)) {
      MemCheckpoint ck(64);
      ck.add("w", dt, shape, grid(shape, {{3, 6, 9}, {}}));
      SECTION("column shard") {
        auto t = targets_for("w", dt, shape, {Box{{0, 3}, {12, 4}}});
        load_and_check(ck, t);
      }
      SECTION("full tensor") {
        auto t = targets_for("w", dt, shape, {Box::whole(shape)});
        auto st = load_and_check(ck, t);
        CHECK(st.bytes_read == 120 * ferry::dtype_size(dt));
      }
      SECTION("three uneven row pieces") {
        auto t = targets_for("w", dt, shape, grid(shape, {{5, 6}, {}}));
        load_and_check(ck, t);
      }
      SECTION("grid blocks") {
        auto t = targets_for("w", dt, shape, grid(shape, {{4, 7}, {3}}));
        load_and_check(ck, t);
      }
    }
  }
}

TEST_CASE("2x2 grid saved, loaded as rows", "[load_plan]") {
  const std::vector<int64_t> shape{9, 14};
  MemCheckpoint ck(64);
  ck.add("g", DType::i32, shape, grid(shape, {{4}, {6}}));
  auto t = targets_for("g", DType::i32, shape, grid(shape, {{2, 3, 7}, {}}));
  load_and_check(ck, t);
  auto whole = targets_for("g", DType::i32, shape, {Box::whole(shape)});
  load_and_check(ck, whole);
}

TEST_CASE("3-D tensor resharded across different dimensions", "[load_plan]") {
  const std::vector<int64_t> shape{4, 5, 6};
  MemCheckpoint ck(64);
  ck.add("x", DType::f16, shape, grid(shape, {{}, {2}, {}}));
  auto t = targets_for("x", DType::f16, shape, grid(shape, {{1, 3}, {}, {4}}));
  load_and_check(ck, t);
  auto odd = targets_for("x", DType::f16, shape, {Box{{1, 1, 1}, {2, 3, 4}}});
  load_and_check(ck, odd);
}

TEST_CASE("zero-size tensors need no reads", "[load_plan]") {
  MemCheckpoint ck(64);
  ck.add("empty0", DType::f32, {0, 5}, {});
  ck.add("empty1", DType::f32, {3, 0}, {Box{{0, 0}, {3, 0}}});
  ferry::StateDict sd;
  REQUIRE(sd.add("empty0", ferry::TensorView{nullptr, DType::f32, {0, 5}}).ok());
  REQUIRE(sd.add("empty1", ferry::TensorView{nullptr, DType::f32, {3, 0}}).ok());
  auto reqs = ferry::make_load_requests(sd);
  REQUIRE(reqs.ok());
  auto plan = ferry::make_load_plan(ck.manifest(), *reqs);
  REQUIRE(plan.ok());
  CHECK(plan->empty());
}

TEST_CASE("0-d scalars", "[load_plan]") {
  MemCheckpoint ck(64);
  ck.add("step", DType::i64, {}, {Box{}});
  ck.add("lr", DType::f32, {}, {Box{}});
  std::vector<Target> t{{"step", DType::i64, {}, Box{}, {}}, {"lr", DType::f32, {}, Box{}, {}}};
  auto st = load_and_check(ck, t);
  CHECK(st.reads == 2);
  CHECK(st.bytes_read == 12);
}

TEST_CASE("small checksum blocks: only the touched blocks are read", "[load_plan]") {
  const std::vector<int64_t> shape{32, 32};
  MemCheckpoint ck(64);  // 16 f32 per block: half a row
  ck.add("m", DType::f32, shape, {Box::whole(shape)});

  SECTION("a small sub-box") {
    auto t = targets_for("m", DType::f32, shape, {Box{{10, 4}, {3, 4}}});
    auto st = load_and_check(ck, t);
    // Rows 10..12, columns 4..7: the first block of each of three rows.
    CHECK(st.bytes_read == 3 * 64);
    CHECK(st.reads == 3);
    CHECK(st.bytes_read < 32 * 32 * 4);
  }
  SECTION("a column crossing blocks merges adjacent ones") {
    auto t = targets_for("m", DType::f32, shape, {Box{{0, 12}, {32, 8}}});
    auto st = load_and_check(ck, t);
    // Columns 12..19 touch both blocks of every row: adjacent, so one read.
    CHECK(st.reads == 1);
    CHECK(st.bytes_read == 32 * 32 * 4);
  }
  SECTION("reads split at block boundaries past max_read_bytes") {
    ferry::LoadPlanOptions opts;
    opts.max_read_bytes = 200;  // three blocks
    auto t = targets_for("m", DType::f32, shape, grid(shape, {{7, 20}, {5}}));
    auto st = load_and_check(ck, t, opts);
    CHECK(st.reads > 3);
  }
  SECTION("short last block") {
    MemCheckpoint odd(64);
    odd.add("o", DType::u8, {10, 15}, {Box::whole({10, 15})});  // 150 bytes: 64 + 64 + 22
    auto t = targets_for("o", DType::u8, {10, 15}, {Box{{9, 14}, {1, 1}}});
    auto st = load_and_check(odd, t);
    CHECK(st.bytes_read == 22);
  }
}

// A whole chunk read as the sharding saved it: its blocks are planned
// without walking the region's runs, and every read of it, however it is
// split, carries the chunk's boxes (the last read takes them over).
TEST_CASE("whole chunks: every split read carries the chunk's boxes", "[load_plan]") {
  MemCheckpoint ck(64);
  ck.add("o", DType::u8, {10, 15}, {Box::whole({10, 15})});  // 150 bytes: 64 + 64 + 22
  ck.add("r", DType::f32, {8, 8}, grid({8, 8}, {{3}, {}}));  // two row chunks
  SECTION("one block a read") {
    ferry::LoadPlanOptions opts;
    opts.max_read_bytes = 64;
    auto plan = ferry::make_load_plan(ck.manifest(), {[] {
                                        ferry::LoadRequest r;
                                        r.key = "o";
                                        r.dtype = DType::u8;
                                        r.global_shape = {10, 15};
                                        r.box = Box::whole({10, 15});
                                        return r;
                                      }()},
                                      opts);
    REQUIRE(plan.ok());
    REQUIRE(plan->size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      const ferry::ReadOp& op = (*plan)[i];
      CHECK(op.first_block == i);
      CHECK(op.nblocks == 1);
      CHECK(op.length == (i < 2 ? 64u : 22u));
      CHECK(op.region == Box::whole({10, 15}));
      CHECK(op.chunk_box == Box::whole({10, 15}));
      CHECK(op.target_box == Box::whole({10, 15}));
    }
    auto t = targets_for("o", DType::u8, {10, 15}, {Box::whole({10, 15})});
    auto st = load_and_check(ck, t, opts);
    CHECK(st.reads == 3);
    CHECK(st.bytes_read == 150);
  }
  SECTION("a tensor of two chunks, whole") {
    auto plan = plan_for(ck, "r", DType::f32, {8, 8}, Box::whole({8, 8}));
    REQUIRE(plan.ok());
    REQUIRE(plan->size() == 2);
    CHECK((*plan)[0].region == Box{{0, 0}, {3, 8}});
    CHECK((*plan)[0].chunk_box == Box{{0, 0}, {3, 8}});
    CHECK((*plan)[1].region == Box{{3, 0}, {5, 8}});
    CHECK((*plan)[1].chunk_box == Box{{3, 0}, {5, 8}});
    CHECK((*plan)[1].target_box == Box::whole({8, 8}));
    auto t = targets_for("r", DType::f32, {8, 8}, {Box::whole({8, 8})});
    auto st = load_and_check(ck, t);
    CHECK(st.bytes_read == 8 * 8 * 4);
  }
}

TEST_CASE("random tilings round-trip through any resharding", "[load_plan]") {
  std::mt19937 rng(42);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto cuts_for = [&](int64_t n) {
    std::vector<int64_t> c;
    for (int64_t p = 1; p < n; ++p)
      if (pick(0, 3) == 0) c.push_back(p);
    return c;
  };
  const DType dtypes[] = {DType::u8, DType::i16, DType::f32, DType::f64};
  for (int iter = 0; iter < 150; ++iter) {
    const auto rank = static_cast<size_t>(pick(1, 3));
    std::vector<int64_t> shape;
    for (size_t k = 0; k < rank; ++k) shape.push_back(pick(1, rank == 3 ? 7 : 13));
    std::vector<std::vector<int64_t>> save_cuts, load_cuts;
    for (int64_t n : shape) {
      save_cuts.push_back(cuts_for(n));
      load_cuts.push_back(cuts_for(n));
    }
    const DType dt = dtypes[pick(0, 3)];
    MemCheckpoint ck(static_cast<uint64_t>(pick(1, 40)));
    ck.add("t", dt, shape, grid(shape, save_cuts));
    ferry::LoadPlanOptions opts;
    opts.max_read_bytes = static_cast<uint64_t>(pick(1, 200));
    auto t = targets_for("t", dt, shape, grid(shape, load_cuts));
    INFO("iteration " << iter);
    load_and_check(ck, t, opts);
  }
}

TEST_CASE("many chunks: the chunk index finds the right ones", "[load_plan]") {
  SECTION("1,024 row chunks, each loaded by its own request and across boundaries") {
    const std::vector<int64_t> shape{1024, 3};
    MemCheckpoint ck(1 << 20);
    std::vector<int64_t> cuts;
    for (int64_t i = 1; i < 1024; ++i) cuts.push_back(i);
    ck.add("rows", DType::f32, shape, grid(shape, {cuts, {}}));
    std::vector<int64_t> load_cuts;
    for (int64_t i = 3; i < 1024; i += 7) load_cuts.push_back(i);
    auto t = targets_for("rows", DType::f32, shape, grid(shape, {load_cuts, {}}));
    load_and_check(ck, t);
  }
  SECTION("an uneven 8x8 grid loaded as random boxes") {
    const std::vector<int64_t> shape{40, 30};
    MemCheckpoint ck(16);
    ck.add("g", DType::i32, shape,
           grid(shape, {{1, 5, 6, 13, 20, 31, 38}, {2, 3, 9, 17, 22, 25, 29}}));
    std::mt19937 rng(7);
    std::vector<Box> boxes;
    for (int i = 0; i < 50; ++i) {
      Box b;
      for (int64_t n : shape) {
        int64_t a = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
        int64_t e = std::uniform_int_distribution<int64_t>(a + 1, n)(rng);
        b.offsets.push_back(a);
        b.sizes.push_back(e - a);
      }
      boxes.push_back(b);
    }
    for (const auto& b : boxes) {
      auto t = targets_for("g", DType::i32, shape, {b});
      load_and_check(ck, t);
    }
  }
}

TEST_CASE("load planning errors name the key", "[load_plan]") {
  const std::vector<int64_t> shape{8, 4};
  MemCheckpoint ck(64);
  ck.add("layer.weight", DType::bf16, shape, grid(shape, {{4}, {}}));
  ck.add("holey", DType::f32, shape, {Box{{0, 0}, {4, 4}}});  // rows 4..7 were never saved

  SECTION("missing key") {
    auto p = plan_for(ck, "layer.bias", DType::bf16, shape, Box::whole(shape));
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == ferry::StatusCode::not_found);
    CHECK_THAT(p.status().message(), Catch::Contains("layer.bias"));
  }
  SECTION("dtype mismatch") {
    auto p = plan_for(ck, "layer.weight", DType::f32, shape, Box::whole(shape));
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == ferry::StatusCode::invalid_argument);
    CHECK_THAT(p.status().message(), Catch::Contains("layer.weight"));
    CHECK_THAT(p.status().message(), Catch::Contains("BF16"));
    CHECK_THAT(p.status().message(), Catch::Contains("F32"));
  }
  SECTION("global shape mismatch") {
    auto p = plan_for(ck, "layer.weight", DType::bf16, {8, 5}, Box::whole({8, 5}));
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == ferry::StatusCode::invalid_argument);
    CHECK_THAT(p.status().message(), Catch::Contains("layer.weight"));
    CHECK_THAT(p.status().message(), Catch::Contains("[8, 4]"));
    CHECK_THAT(p.status().message(), Catch::Contains("[8, 5]"));
  }
  SECTION("region not covered") {
    auto ok = plan_for(ck, "holey", DType::f32, shape, Box{{1, 0}, {3, 4}});
    CHECK(ok.ok());
    auto p = plan_for(ck, "holey", DType::f32, shape, Box{{2, 1}, {4, 2}});
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == ferry::StatusCode::invalid_argument);
    CHECK_THAT(p.status().message(), Catch::Contains("holey"));
    CHECK_THAT(p.status().message(), Catch::Contains("[2:6, 1:3]"));
  }
  SECTION("box outside the global shape") {
    auto p = plan_for(ck, "layer.weight", DType::bf16, shape, Box{{6, 0}, {4, 4}});
    REQUIRE_FALSE(p.ok());
    CHECK_THAT(p.status().message(), Catch::Contains("layer.weight"));
  }
}

TEST_CASE("2,000 small tensors plan quickly", "[load_plan]") {
  MemCheckpoint ck(1 << 20);
  ferry::StateDict sd;
  std::vector<std::vector<float>> bufs(2000);
  // Keys in insertion order differ from sorted order, as in a real model.
  for (int i = 0; i < 2000; ++i) {
    const std::string key = "layers." + std::to_string(i) + ".weight";
    ck.add(key, DType::f32, {16, 8}, grid({16, 8}, {{8}, {}}));
  }
  for (int i = 0; i < 2000; ++i) {
    bufs[i].resize(8 * 8);
    REQUIRE(sd.add("layers." + std::to_string(i) + ".weight",
                   ferry::TensorView{bufs[i].data(), DType::f32, {8, 8}},
                   ferry::Shard{{16, 8}, {4, 0}})
                .ok());
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto reqs = ferry::make_load_requests(sd);
  REQUIRE(reqs.ok());
  auto plan = ferry::make_load_plan(ck.manifest(), *reqs);
  const auto dt = std::chrono::steady_clock::now() - t0;
  REQUIRE(plan.ok());
  CHECK(plan->size() == 4000);  // rows 4..11 straddle both chunks
  // Generous for a Debug build on a loaded machine; the work is tiny.
  CHECK(std::chrono::duration_cast<std::chrono::milliseconds>(dt).count() < 1000);
}

TEST_CASE("tensors_not_requested lists the checkpoint keys no request asks for", "[load_plan]") {
  ferry::Manifest m;
  for (const char* k : {"emb", "layers.0.b", "layers.0.w", "opt.step"}) {
    ferry::ManifestTensor t;
    t.key = k;
    m.tensors.push_back(t);
  }
  auto req = [](const std::string& key) {
    ferry::LoadRequest r;
    r.key = key;
    return r;
  };
  CHECK(ferry::tensors_not_requested(m, {req("opt.step"), req("emb")}) ==
        std::vector<std::string>{"layers.0.b", "layers.0.w"});
  CHECK(ferry::tensors_not_requested(m, {}) ==
        std::vector<std::string>{"emb", "layers.0.b", "layers.0.w", "opt.step"});
  CHECK(ferry::tensors_not_requested(
            m, {req("layers.0.w"), req("opt.step"), req("emb"), req("layers.0.b")})
            .empty());
}
