// The loader alone, on rank 1 of 2, receiving the bytes rank 0 read for it:
// BlockShare frames are fed in as the link would. Rank 1 loads the second
// half of a tensor's rows whose one checksum block both ranks need, so only
// its rows travel, under each frame's own checksum: the rows land, and a
// frame changed on its way, or one that is not what rank 1 expects, fails
// the load naming rank 0, leaving no byte of it in the tensor.

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "actor_fixture.hpp"
#include "checksum.hpp"
#include "load_plan.hpp"
#include "protocol.hpp"

namespace {

using ferry::Status;

constexpr int64_t kRows = 64, kCols = 1024;
constexpr uint64_t kStart = 4096;  // the tensor's first byte in the file

ferry::Manifest one_tensor() {
  ferry::Manifest m;
  ferry::ManifestTensor t;
  t.key = "w";
  t.dtype = ferry::DType::f32;
  t.global_shape = {kRows, kCols};
  ferry::ManifestChunk c;
  c.offsets = {0, 0};
  c.sizes = t.global_shape;
  c.byte_offset = kStart;
  c.byte_length = kRows * kCols * 4;
  c.checksums = {1};  // one block (1 MiB) holds the whole tensor
  c.entry = "w";
  t.chunks.push_back(c);
  m.tensors.push_back(t);
  ferry::ManifestFile f;
  f.name = "rank-00000-0000.safetensors";
  f.size = kStart + c.byte_length;
  m.files.push_back(f);
  return m;
}

// Rank r loads rows [r * 32, r * 32 + 32).
std::vector<ferry::ReadOp> plan_of(const ferry::Manifest& m, int r) {
  ferry::LoadRequest req;
  req.key = "w";
  req.dtype = ferry::DType::f32;
  req.global_shape = {kRows, kCols};
  req.box = ferry::Box{{r * kRows / 2, 0}, {kRows / 2, kCols}};
  auto ops = ferry::make_load_plan(m, {req});
  REQUIRE(ops.ok());
  return ops.value();
}

struct Receiver : ferry::testing::ActorSystem {
  std::shared_ptr<ferry::RankContext> ctx = ferry::testing::rank_context(1, 2);
  std::shared_ptr<const ferry::Manifest> manifest =
      std::make_shared<const ferry::Manifest>(one_tensor());
  std::vector<float> rows = std::vector<float>(kRows / 2 * kCols, -1.0f);
  std::vector<char> file = std::vector<char>(kStart + kRows * kCols * 4);
  ferry::loader_actor loader;
  ferry::LoadJob job;

  Receiver() {
    ctx->device = ferry::host_device();
    for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<char>(i * 2654435761u >> 11);
    loader = ferry::spawn_loader(*sys, ctx);
    std::vector<ferry::RankNeeds> needs;
    for (int r = 0; r < 2; ++r)
      needs.push_back({r, "node", ferry::needed_ranges(plan_of(*manifest, r), *manifest)});
    const auto shared = ferry::assign_shared_reads(needs);
    REQUIRE(shared.size() == 1);
    REQUIRE(shared[0].reader == 0);  // rank 0 reads the block for both
    auto part = ferry::split_for_rank(plan_of(*manifest, 1), shared, 1, *manifest);
    REQUIRE(part.read.empty());
    REQUIRE(part.receive.size() == 1);
    job.manifest = manifest;
    job.receive = part.receive;
    job.load_id = "load-1";
    job.targets = {ferry::TensorView(rows.data(), ferry::DType::f32, {kRows / 2, kCols})};
  }
  ~Receiver() { caf::anon_send_exit(loader, caf::exit_reason::user_shutdown); }

  // The bytes rank 0 sends rank 1: its rows, and nothing before them.
  uint64_t first() const { return kStart + kRows / 2 * kCols * 4; }
  uint64_t length() const { return kRows / 2 * kCols * 4; }

  ferry::BlockShareMsg frame(uint64_t offset, uint64_t n) const {
    std::string bytes(file.data() + offset, n);
    const uint64_t sum = ferry::xxh3_64(bytes.data(), bytes.size());
    return ferry::BlockShareMsg{"job",    job.load_id,      0,  1, 0, offset,
                                Status(), std::move(bytes), sum};
  }
  void send(const ferry::BlockShareMsg& m) { caf::anon_send(loader, ferry::atom::share_v, m); }

  bool rows_landed() const {
    return std::memcmp(rows.data(), file.data() + first(), length()) == 0;
  }
  bool rows_untouched() const {
    for (float v : rows)
      if (v != -1.0f) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("a receiver gets only its rows of a shared block, each frame under its own checksum",
          "[load][share]") {
  Receiver r;
  REQUIRE(r.job.receive[0].first == 0);
  CHECK(r.job.receive[0].second.file_offset == r.first());
  CHECK(r.job.receive[0].second.length == r.length());

  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  // Two frames, cut where no row ends, the second first.
  const uint64_t cut = 40000;
  r.send(r.frame(r.first() + cut, r.length() - cut));
  r.send(r.frame(r.first(), cut));
  const Status s = load.answer();
  INFO(s.to_string());
  CHECK(s.ok());
  CHECK(r.rows_landed());
}

TEST_CASE("a shared frame changed on its way fails the load naming its sender", "[load][share]") {
  Receiver r;
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  ferry::BlockShareMsg m = r.frame(r.first(), r.length());
  std::string bytes(m.data.view());
  bytes[12345] ^= 0x10;
  m.data = std::move(bytes);
  r.send(m);
  const Status s = load.answer();
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.to_string(), Catch::Contains("rank 1") && Catch::Contains("from rank 0") &&
                                Catch::Contains("do not match their checksum"));
  CHECK(r.rows_untouched());
}

TEST_CASE("shared bytes rank 1 did not ask for fail the load naming their sender",
          "[load][share]") {
  Receiver r;
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  // Rank 0's own rows: inside the block both ranks need, outside rank 1's part.
  r.send(r.frame(kStart, 4096));
  const Status s = load.answer();
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.to_string(), Catch::Contains("from rank 0") &&
                                Catch::Contains("match no piece it expects from that rank"));
  CHECK(r.rows_untouched());
}
