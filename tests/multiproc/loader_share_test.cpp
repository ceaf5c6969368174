// The loader alone, on rank 1 of 2, receiving the bytes rank 0 read for it:
// BlockShare frames are fed in as the link would. Rank 1 loads the second
// half of a tensor's rows (or of its columns) whose one checksum block both
// ranks need, so only its rows (its columns, packed) travel, under each
// frame's own checksum: they land, and a frame changed on its way, or one
// that is not what rank 1 expects, fails the load naming rank 0, leaving no
// byte of it in the tensor. The same holds for bytes rank 0 put in rank 1's
// share ring, which the frame only points at.

#include <catch2/catch.hpp>

#include <cstring>
#include <functional>
#include <vector>

#include "actor_fixture.hpp"
#include "checksum.hpp"
#include "load_plan.hpp"
#include "protocol.hpp"
#include "share_ring.hpp"

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

// Rank r loads rows [r * 32, r * 32 + 32), or by columns [r * 512, r * 512 + 512).
ferry::Box box_of(int r, bool by_cols) {
  return by_cols ? ferry::Box{{0, r * kCols / 2}, {kRows, kCols / 2}}
                 : ferry::Box{{r * kRows / 2, 0}, {kRows / 2, kCols}};
}

std::vector<ferry::ReadOp> plan_of(const ferry::Manifest& m, int r, bool by_cols) {
  ferry::LoadRequest req;
  req.key = "w";
  req.dtype = ferry::DType::f32;
  req.global_shape = {kRows, kCols};
  req.box = box_of(r, by_cols);
  auto ops = ferry::make_load_plan(m, {req});
  REQUIRE(ops.ok());
  return ops.value();
}

struct Receiver : ferry::testing::ActorSystem {
  bool by_cols = false;
  std::shared_ptr<ferry::RankContext> ctx = ferry::testing::rank_context(1, 2);
  std::shared_ptr<const ferry::Manifest> manifest =
      std::make_shared<const ferry::Manifest>(one_tensor());
  std::vector<float> got = std::vector<float>(kRows / 2 * kCols, -1.0f);
  std::vector<char> file = std::vector<char>(kStart + kRows * kCols * 4);
  ferry::loader_actor loader;
  ferry::LoadJob job;

  explicit Receiver(bool cols = false) : by_cols(cols) {
    ctx->device = ferry::host_device();
    for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<char>(i * 2654435761u >> 11);
    loader = ferry::spawn_loader(*sys, ctx);
    std::vector<ferry::RankNeeds> needs;
    for (int r = 0; r < 2; ++r)
      needs.push_back(
          {r, "node", ferry::needed_ranges(plan_of(*manifest, r, by_cols), *manifest), {}});
    const auto shared = ferry::assign_shared_reads(needs);
    REQUIRE(shared.size() == 1);
    REQUIRE(shared[0].reader == 0);  // rank 0 reads the block for both
    auto part = ferry::split_for_rank(plan_of(*manifest, 1, by_cols), shared, 1, *manifest);
    REQUIRE(part.read.empty());
    REQUIRE(part.receive.size() == 1);
    job.manifest = manifest;
    job.receive = part.receive;
    job.load_id = "load-1";
    const ferry::Box mine = box_of(1, by_cols);
    job.targets = std::make_shared<std::vector<ferry::TensorView>>(std::vector<ferry::TensorView>{
        ferry::TensorView(got.data(), ferry::DType::f32, mine.sizes)});
  }
  ~Receiver() { caf::anon_send_exit(loader, caf::exit_reason::user_shutdown); }

  // What rank 0 sends rank 1: its box's elements, packed in row-major
  // order (its rows: one stretch of the file; its columns: half of each row).
  std::string stream() const {
    std::string out;
    const ferry::Box mine = box_of(1, by_cols);
    for (int64_t i = mine.offsets[0]; i < mine.offsets[0] + mine.sizes[0]; ++i)
      out.append(file.data() + kStart + (i * kCols + mine.offsets[1]) * 4, mine.sizes[1] * 4);
    return out;
  }
  // Where stream byte `at` lies in the file.
  uint64_t file_offset(uint64_t at) const {
    const ferry::Box mine = box_of(1, by_cols);
    const uint64_t row = at / (mine.sizes[1] * 4), in = at % (mine.sizes[1] * 4);
    return kStart + ((mine.offsets[0] + row) * kCols + mine.offsets[1]) * 4 + in;
  }

  // Stream bytes [at, at + n) as one frame.
  ferry::BlockShareMsg frame(uint64_t at, uint64_t n) const {
    std::string bytes = stream().substr(at, n);
    const uint64_t sum = ferry::xxh3_64(bytes.data(), bytes.size());
    return ferry::BlockShareMsg{"job",    job.load_id,      0,  1, 0, file_offset(at),
                                Status(), std::move(bytes), sum};
  }
  // The same bytes put in rank 1's share ring by rank 0 (its mapping of
  // the ring, opened as a sender of another process would, by /proc); the
  // frame says where. Needs offer_ring() first.
  ferry::BlockShareMsg ring_frame(uint64_t at, uint64_t n) {
    ferry::BlockShareMsg m = frame(at, n);
    m.ring_offset = sender->place(n);
    m.ring_length = n;
    std::memcpy(sender->at(m.ring_offset), m.data.data(), n);
    m.data = ferry::SharedBytes();
    return m;
  }
  void offer_ring() {
    auto ring = ferry::ShareRing::create(2, ctx->opts.share_window_bytes);
    REQUIRE(ring.ok());
    job.ring = std::move(ring).value();
    auto peer = ferry::PeerRing::open(job.ring->info(), 0, 2, ctx->opts.share_window_bytes);
    INFO(peer.status().to_string());
    REQUIRE(peer.ok());
    sender = std::move(peer).value();
  }
  std::unique_ptr<ferry::PeerRing> sender;
  void send(const ferry::BlockShareMsg& m) { caf::anon_send(loader, ferry::atom::share_v, m); }

  bool landed() const { return std::memcmp(got.data(), stream().data(), stream().size()) == 0; }
  bool untouched() const {
    for (float v : got)
      if (v != -1.0f) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("a receiver gets only its rows or columns of a shared block, under frame checksums",
          "[load][share]") {
  const bool by_cols = GENERATE(false, true);
  // The bytes in the frames, or put in rank 1's share ring by rank 0.
  const bool in_ring = GENERATE(false, true);
  INFO((by_cols ? "columns" : "rows") << (in_ring ? ", in the ring" : ", in the frames"));
  Receiver r(by_cols);
  if (in_ring) r.offer_ring();
  REQUIRE(r.job.receive[0].first == 0);
  const uint64_t n = kRows * kCols * 4 / 2;
  CHECK(ferry::shared_bytes(r.job.receive[0].second, 4) == n);

  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  // Two frames, cut inside a row, the second first.
  const uint64_t cut = 40000;
  auto frame = [&](uint64_t at, uint64_t len) {
    return in_ring ? r.ring_frame(at, len) : r.frame(at, len);
  };
  r.send(frame(cut, n - cut));
  r.send(frame(0, cut));
  const Status s = load.answer();
  INFO(s.to_string());
  CHECK(s.ok());
  CHECK(r.landed());
}

TEST_CASE("a load that starts after its sender was reported failed fails at once and names it",
          "[load][share]") {
  // The report of rank 0's failure reaches the loader before the load that
  // expects rank 0's bytes (the ranks found it dead while this one was still
  // planning): the load fails on the report, not at write-timeout.
  Receiver r(false);
  r.ctx->opts.write_timeout_s = 3;  // the old behaviour: a timeout error after this
  // As the link does: the failure on record, then the report to the loader.
  const Status lost = Status::aborted("rank 0: connection lost");
  r.ctx->shares->fail_rank(0, lost);
  r.send(ferry::BlockShareMsg{"job", ferry::kAnyLoad, 0, 1, 0, 0, lost, "", 0});
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  const Status s = load.answer();
  INFO(s.to_string());
  CHECK(s.code() == ferry::StatusCode::aborted);
  CHECK_THAT(s.to_string(), Catch::Contains("rank 1 was waiting for bytes rank 0 reads for it") &&
                                Catch::Contains("connection lost"));
  CHECK(r.untouched());
}

TEST_CASE("a shared frame changed on its way fails the load naming its sender", "[load][share]") {
  // Rows go to one stretch of the tensor and are summed as they are copied;
  // columns are checked before any byte of them is copied.
  const bool by_cols = GENERATE(false, true);
  const bool in_ring = GENERATE(false, true);
  INFO((by_cols ? "columns" : "rows") << (in_ring ? ", in the ring" : ", in the frames"));
  Receiver r(by_cols);
  if (in_ring) r.offer_ring();
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  const uint64_t n = kRows * kCols * 4 / 2;
  ferry::BlockShareMsg m = in_ring ? r.ring_frame(0, n) : r.frame(0, n);
  if (in_ring) {
    r.sender->at(m.ring_offset)[12345] ^= 0x10;
  } else {
    std::string bytes(m.data.view());
    bytes[12345] ^= 0x10;
    m.data = std::move(bytes);
  }
  r.send(m);
  const Status s = load.answer();
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.to_string(), Catch::Contains("rank 1") && Catch::Contains("from rank 0") &&
                                Catch::Contains("do not match their checksum"));
  // Rows landed before their sum failed, and the error says where; columns
  // never reached the tensor.
  if (by_cols) {
    CHECK(r.untouched());
    CHECK_THAT(s.to_string(), !Catch::Contains("unverified"));
  } else {
    CHECK_THAT(s.to_string(), Catch::Contains("unverified bytes were left in tensor 'w'"));
  }
}

TEST_CASE("ring bytes changed once their frame checked out never reach the tensor",
          "[load][share]") {
  // Any process of the user can write a loading rank's ring. A write right
  // after the check (the seam) must not land: what is used is what was checked.
  const bool by_cols = GENERATE(false, true);
  INFO((by_cols ? "columns" : "rows"));
  Receiver r(by_cols);
  r.offer_ring();
  const uint64_t n = kRows * kCols * 4 / 2, cut = 40000;
  std::vector<ferry::BlockShareMsg> frames = {r.ring_frame(0, cut), r.ring_frame(cut, n - cut)};
  size_t checked = 0;
  const std::function<void()> change = [&] {
    // The frame just checked (they come in the order sent), changed in its
    // ring bytes; the loader's thread runs this, the test's waits.
    if (checked < frames.size()) {
      const auto& f = frames[checked];
      r.sender->at(f.ring_offset)[f.ring_length / 2] ^= 0x40;
    }
    ++checked;
  };
  ferry::set_share_checked_hook(&change);
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  for (const auto& f : frames) r.send(f);
  const Status s = load.answer();
  ferry::set_share_checked_hook(nullptr);
  INFO(s.to_string());
  CHECK(checked == 2);  // the seam ran for each frame, so the check below can fail
  CHECK(s.ok());
  CHECK(r.landed());
}

TEST_CASE("shared bytes rank 1 did not ask for fail the load naming their sender",
          "[load][share]") {
  const bool by_cols = GENERATE(false, true);
  INFO((by_cols ? "columns" : "rows"));
  Receiver r(by_cols);
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  // Rank 0's own first element: inside the block both ranks need, outside
  // rank 1's box. (Its sum is right: the bytes are whole, just not asked for.)
  ferry::BlockShareMsg m = r.frame(0, 4096);
  m.offset = kStart;
  r.send(m);
  const Status s = load.answer();
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.to_string(), Catch::Contains("from rank 0") &&
                                Catch::Contains("match no piece it expects from that rank"));
  CHECK(r.untouched());
}

TEST_CASE("a shared frame running past the bytes rank 1 expects fails the load", "[load][share]") {
  Receiver r(true);
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  // Starts at rank 1's last row, and is longer than what is left of its stream.
  const uint64_t row = kCols * 4 / 2;
  ferry::BlockShareMsg m = r.frame(kRows * row - row, row);
  std::string bytes = std::string(m.data.view()) + std::string(64, 'x');
  m.checksum = ferry::xxh3_64(bytes.data(), bytes.size());
  m.data = std::move(bytes);
  r.send(m);
  const Status s = load.answer();
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.to_string(), Catch::Contains("from rank 0") && Catch::Contains("match no piece"));
  CHECK(r.untouched());
}

TEST_CASE("a share ring frame outside its sender's region or changed in the ring fails the load",
          "[load][share]") {
  const int how = GENERATE(0, 1, 2, 3);
  Receiver r(true);
  const uint64_t n = kRows * kCols * 4 / 2;
  std::string expect;
  ferry::BlockShareMsg m;
  if (how == 3) {
    // A ring frame to a rank that offered no ring.
    m = r.frame(0, n);
    m.ring_offset = ferry::ring_region_offset(0, r.ctx->opts.share_window_bytes);
    m.ring_length = n;
    m.data = ferry::SharedBytes();
    expect = "outside that rank's region";
  } else {
    r.offer_ring();
    m = r.ring_frame(0, n);
    const uint64_t window = r.ctx->opts.share_window_bytes;
    if (how == 0) {
      m.ring_offset = ferry::ring_region_offset(1, window);  // rank 1's own region
      expect = "outside that rank's region";
    } else if (how == 1) {
      // Starts in rank 0's region, runs past it.
      m.ring_offset = ferry::ring_region_offset(1, window) - n / 2;
      expect = "outside that rank's region";
    } else {
      r.sender->at(m.ring_offset)[777] ^= 0x01;
      expect = "do not match their checksum";
    }
  }
  INFO("case " << how);
  ferry::testing::Ask<Status> load(*r.sys, r.loader, ferry::atom::load_v, r.job);
  r.send(m);
  const Status s = load.answer();
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.to_string(), Catch::Contains("from rank 0") && Catch::Contains(expect));
  CHECK(r.untouched());
}
