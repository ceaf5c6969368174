// Load's data path: O_DIRECT runs into staging blocks where the filesystem
// takes O_DIRECT, buffered reads that drop their pages where it does not
// (tmpfs before Linux 6.6, or direct-io = false), streaming through a pool smaller than the state,
// reads limited to the blocks a resharded load needs, and per-block corruption reports.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <string>

#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "manifest.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;

namespace {

// A scratch directory under `base` (a tmpfs like /dev/shm, or a disk).
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& base) {
    std::string tmpl = base + "/ferry-load-test-XXXXXX";
    path_ = mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Counts the bytes read through its files and whether any took O_DIRECT.
class CountingFs : public ferry::FilesystemWrapper {
 public:
  CountingFs() : FilesystemWrapper(ferry::posix_filesystem()) {}

  struct Counts {
    std::atomic<uint64_t> bytes_read{0};
    std::atomic<int> direct_opens{0};
    std::atomic<int> buffered_opens{0};
    std::mutex mu;
    std::vector<std::pair<const uint8_t*, size_t>> reads;  // buffer and length of each pread
    // Whether a pread wrote into [p, p + n).
    bool read_into(const void* p, size_t n) {
      std::lock_guard<std::mutex> l(mu);
      const auto* b = static_cast<const uint8_t*>(p);
      for (const auto& [at, len] : reads)
        if (at < b + n && b < at + len) return true;
      return false;
    }
  };

  class CountingFile : public ferry::File {
   public:
    CountingFile(std::unique_ptr<ferry::File> f, std::shared_ptr<Counts> c)
        : f_(std::move(f)), c_(std::move(c)) {}
    const std::string& path() const override { return f_->path(); }
    bool direct() const override { return f_->direct(); }
    ferry::Status pwrite(const void* d, size_t n, uint64_t off) override {
      return f_->pwrite(d, n, off);
    }
    ferry::Result<size_t> pread(void* d, size_t n, uint64_t off) override {
      auto r = f_->pread(d, n, off);
      if (r.ok()) c_->bytes_read += r.value();
      std::lock_guard<std::mutex> l(c_->mu);
      c_->reads.emplace_back(static_cast<const uint8_t*>(d), n);
      return r;
    }
    ferry::Status truncate(uint64_t n) override { return f_->truncate(n); }
    ferry::Status sync() override { return f_->sync(); }
    ferry::Status close() override { return f_->close(); }

   private:
    std::unique_ptr<ferry::File> f_;
    std::shared_ptr<Counts> c_;
  };

  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    auto r = target_->open(p, o);
    if (!r.ok()) return r.status();
    if (!o.write && p.find(".safetensors") != std::string::npos)
      ++(r.value()->direct() ? counts->direct_opens : counts->buffered_opens);
    return std::unique_ptr<ferry::File>(new CountingFile(std::move(r).value(), counts));
  }

  void reset() {
    std::lock_guard<std::mutex> l(counts->mu);
    counts->reads.clear();
    counts->bytes_read = 0;
    counts->direct_opens = 0;
    counts->buffered_opens = 0;
  }

  std::shared_ptr<Counts> counts = std::make_shared<Counts>();
};

std::unique_ptr<ferry::Runtime> make_runtime(
    const std::string& root, std::shared_ptr<ferry::Filesystem> fsys,
    std::vector<std::pair<std::string, std::string>> kv = {}) {
  kv.insert(kv.begin(), {"readers", "2"});
  return ferry::testing::make_test_runtime(root, {std::move(kv), std::move(fsys)});
}

struct Buf {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape;
  Buf(std::vector<int64_t> s, uint64_t seed) : shape(std::move(s)) {
    int64_t n = 1;
    for (auto x : shape) n *= x;
    bytes.resize(n * 4);
    std::mt19937_64 rng(seed);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  }
  ferry::TensorView view() { return {bytes.data(), ferry::DType::f32, shape}; }
};

// Whether a file under `dir` opens with O_DIRECT through the POSIX filesystem.
bool takes_direct(const std::string& dir) {
  const std::string p = dir + "/probe";
  { std::ofstream(p) << "x"; }
  ferry::OpenOptions o;
  o.direct = true;
  auto f = ferry::posix_filesystem()->open(p, o);
  const bool direct = f.ok() && f.value()->direct();
  fs::remove(p);
  return direct;
}

std::string data_file(const std::string& ckpt) {
  for (const auto& e : fs::directory_iterator(ckpt))
    if (e.path().extension() == ".safetensors") return e.path().string();
  return "";
}

ferry::Manifest read_manifest(const std::string& ckpt) {
  auto bytes = ferry::read_file(*ferry::posix_filesystem(), ckpt + "/MANIFEST");
  REQUIRE(bytes.ok());
  auto m = ferry::decode_manifest(bytes.value());
  REQUIRE(m.ok());
  return std::move(m).value();
}

void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// Pages of `path` in the page cache, and its pages in all.
std::pair<size_t, size_t> resident_pages(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  const size_t size = fs::file_size(path);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  REQUIRE(map != MAP_FAILED);
  std::vector<unsigned char> vec((size + page - 1) / page);
  REQUIRE(::mincore(map, size, vec.data()) == 0);
  ::munmap(map, size);
  size_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return {n, vec.size()};
}

// A disk directory: /var/tmp unless FERRY_TEST_DISK_DIR names another.
std::string disk_base() {
  const char* d = std::getenv("FERRY_TEST_DISK_DIR");
  return d && *d ? d : "/var/tmp";
}

}  // namespace

TEST_CASE("a state larger than the pool streams through it on load, direct and buffered",
          "[actors][load][stream]") {
  const std::string base = GENERATE(std::string("/dev/shm"), disk_base());
  if (!fs::is_directory(base)) FAIL("no directory " << base);
  ScratchDir dir(base);
  REQUIRE(!dir.path().empty());
  const bool direct = takes_direct(dir.path());
  INFO(base << (direct ? " takes O_DIRECT" : " takes buffered reads"));
  // tmpfs takes O_DIRECT from Linux 6.6 on and refuses it before; either way
  // the SECTION below covers buffered reads with direct-io = false.

  auto cfs = std::make_shared<CountingFs>();
  // 1 MiB of pool (4 blocks shared by 2 readers) for about 10 MiB of state,
  // with tensor sizes that leave chunks unaligned in the file.
  auto rt = make_runtime(dir.path(), cfs, {{"pool-bytes", "1MiB"}});
  std::vector<Buf> bufs;
  ferry::StateDict sd;
  for (int i = 0; i < 24; ++i) bufs.emplace_back(std::vector<int64_t>{101 + 7 * i, 1021}, 100 + i);
  for (int i = 0; i < 24; ++i) REQUIRE(sd.add("t" + std::to_string(i), bufs[i].view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  uint64_t total = 0;
  for (auto& b : bufs) total += b.bytes.size();

  std::vector<Buf> outs;
  ferry::StateDict out;
  for (int i = 0; i < 24; ++i) outs.emplace_back(bufs[i].shape, 9000 + i);
  for (int i = 0; i < 24; ++i) REQUIRE(out.add("t" + std::to_string(i), outs[i].view()).ok());
  cfs->reset();
  auto st = rt->load(out, h.path());
  REQUIRE(st.ok());
  for (int i = 0; i < 24; ++i) REQUIRE(outs[i].bytes == bufs[i].bytes);
  // Every byte once, plus the header and alignment padding at run ends.
  CHECK(cfs->counts->bytes_read >= total);
  CHECK(cfs->counts->bytes_read <= total + total / 16 + (64 << 10));
  if (direct) {
    CHECK(cfs->counts->direct_opens > 0);
    CHECK(cfs->counts->buffered_opens == 0);
  } else {
    CHECK(cfs->counts->direct_opens == 0);
    CHECK(cfs->counts->buffered_opens > 0);
  }

  SECTION("direct-io = false reads buffered from the same files") {
    auto rt2 = make_runtime(dir.path(), cfs, {{"pool-bytes", "1MiB"}, {"direct-io", "false"}});
    for (auto& o : outs) std::fill(o.bytes.begin(), o.bytes.end(), 0);
    cfs->reset();
    REQUIRE(rt2->load(out, h.path()).ok());
    for (int i = 0; i < 24; ++i) REQUIRE(outs[i].bytes == bufs[i].bytes);
    CHECK(cfs->counts->direct_opens == 0);
    CHECK(cfs->counts->buffered_opens > 0);
  }
}

// Page-aligned memory for a tensor: what O_DIRECT takes on any device.
struct AlignedTensor {
  uint8_t* p = nullptr;
  std::vector<int64_t> shape;
  size_t n = 0;
  AlignedTensor(std::vector<int64_t> s, uint64_t seed) : shape(std::move(s)) {
    n = 4;
    for (auto x : shape) n *= static_cast<size_t>(x);
    REQUIRE(::posix_memalign(reinterpret_cast<void**>(&p), 4096, n) == 0);
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
  }
  ~AlignedTensor() { std::free(p); }
  AlignedTensor(const AlignedTensor&) = delete;
  AlignedTensor& operator=(const AlignedTensor&) = delete;
  ferry::TensorView view() { return {p, ferry::DType::f32, shape}; }
};

TEST_CASE("large tensors the reads can fill are read straight into, the others through staging",
          "[actors][load][direct]") {
  const std::string base = GENERATE(std::string("/dev/shm"), disk_base());
  const std::string direct_io = GENERATE(std::string("true"), std::string("false"));
  ScratchDir dir(base);
  REQUIRE(!dir.path().empty());
  const bool direct = direct_io == "true" && takes_direct(dir.path());
  INFO(base << (direct ? ": O_DIRECT reads" : ": buffered reads"));
  auto cfs = std::make_shared<CountingFs>();
  // 2 MiB reads: each large tensor is a whole read and a shorter last one
  // that ends off an alignment unit.
  auto rt = make_runtime(
      dir.path(), cfs, {{"direct-io", direct_io}, {"pool-bytes", "8MiB"}, {"chunk-bytes", "2MiB"}});
  // "a" starts the data (an aligned file offset) and ends off any 512-byte
  // boundary, so "b" starts off one; "small" is under the straight-read
  // threshold.
  AlignedTensor a({1000, 1037}, 1), b({900, 1037}, 2), small({10, 1037}, 3);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  REQUIRE(sd.add("b", b.view()).ok());
  REQUIRE(sd.add("small", small.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  evict(data_file(h.path()));

  AlignedTensor a2({1000, 1037}, 11), b2({900, 1037}, 12), small2({10, 1037}, 13);
  ferry::StateDict out;
  REQUIRE(out.add("a", a2.view()).ok());
  REQUIRE(out.add("b", b2.view()).ok());
  REQUIRE(out.add("small", small2.view()).ok());
  cfs->reset();
  REQUIRE(rt->load(out, h.path()).ok());
  CHECK(std::memcmp(a.p, a2.p, a.n) == 0);
  CHECK(std::memcmp(b.p, b2.p, b.n) == 0);
  CHECK(std::memcmp(small.p, small2.p, small.n) == 0);
  CHECK(cfs->counts->read_into(a2.p, a2.n));
  CHECK(!cfs->counts->read_into(small2.p, small2.n));
  // A buffered read takes any offset; O_DIRECT does not take b's.
  CHECK(cfs->counts->read_into(b2.p, b2.n) == !direct);
  const uint64_t total = a.n + b.n + small.n;
  CHECK(cfs->counts->bytes_read <= total + 3 * 8192 + (64 << 10));

  SECTION("read-into-tensors = false stages every read") {
    auto staged = make_runtime(dir.path(), cfs,
                               {{"direct-io", direct_io},
                                {"pool-bytes", "8MiB"},
                                {"chunk-bytes", "2MiB"},
                                {"read-into-tensors", "false"}});
    std::memset(a2.p, 0, a2.n);
    cfs->reset();
    REQUIRE(staged->load(out, h.path()).ok());
    CHECK(std::memcmp(a.p, a2.p, a.n) == 0);
    CHECK(!cfs->counts->read_into(a2.p, a2.n));
    CHECK(!cfs->counts->read_into(b2.p, b2.n));
  }
  SECTION("a tensor shard that is not one contiguous range of the file goes through staging") {
    AlignedTensor cols({1000, 500}, 21);
    ferry::StateDict part;
    REQUIRE(part.add("a", cols.view(), ferry::Shard{{1000, 1037}, {0, 537}}).ok());
    cfs->reset();
    REQUIRE(rt->load(part, h.path()).ok());
    CHECK(!cfs->counts->read_into(cols.p, cols.n));
    for (int64_t r = 0; r < 1000; ++r)
      REQUIRE(std::memcmp(cols.p + r * 500 * 4, a.p + (r * 1037 + 537) * 4, 500 * 4) == 0);
  }
}

TEST_CASE("a read straight into a tensor still checks its blocks and its length",
          "[actors][load][direct][corruption]") {
  const std::string base = GENERATE(std::string("/dev/shm"), disk_base());
  ScratchDir dir(base);
  REQUIRE(!dir.path().empty());
  auto cfs = std::make_shared<CountingFs>();
  auto rt = make_runtime(dir.path(), cfs, {{"pool-bytes", "8MiB"}, {"chunk-bytes", "2MiB"}});
  AlignedTensor a({1000, 1037}, 1);  // 63 blocks of 64 KiB and a partial one
  ferry::StateDict sd;
  REQUIRE(sd.add("weights", a.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  const ferry::Manifest m = read_manifest(h.path());
  const uint64_t start = m.find("weights")->chunks.at(0).byte_offset;
  const std::string data = data_file(h.path());
  AlignedTensor out_t({1000, 1037}, 2);
  ferry::StateDict out;
  REQUIRE(out.add("weights", out_t.view()).ok());

  SECTION("a flipped byte is named by its block") {
    {
      std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(start + 3 * (64 << 10) + 77));
      char c = 0;
      f.read(&c, 1);
      c ^= 0x10;
      f.seekp(static_cast<std::streamoff>(start + 3 * (64 << 10) + 77));
      f.write(&c, 1);
    }
    evict(data);
    auto st = rt->load(out, h.path());
    CHECK(cfs->counts->read_into(out_t.p, out_t.n));
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("'weights'") && Catch::Contains("block 3"));
    // The bytes are in the tensor: the error says so.
    CHECK_THAT(st.message(), Catch::Contains("unverified bytes were left in tensor 'weights'"));
  }
  SECTION("a flipped byte in the last partial unit, read apart, is caught") {
    {
      std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(start + a.n - 3));
      char c = 0;
      f.read(&c, 1);
      c ^= 0x10;
      f.seekp(static_cast<std::streamoff>(start + a.n - 3));
      f.write(&c, 1);
    }
    evict(data);
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("'weights'") && Catch::Contains("block 63"));
  }
  SECTION("a file cut short inside the tensor fails naming it") {
    fs::resize_file(data, start + a.n - 100);
    auto st = rt->load(out, h.path());
    CHECK(!st.ok());
    CHECK_THAT(st.message(), Catch::Contains("weights") && Catch::Contains("truncated"));
  }
}

TEST_CASE("a checksum block larger than a pool block still loads", "[actors][load][stream]") {
  ScratchDir dir(disk_base());
  auto rt = make_runtime(
      dir.path(), nullptr,
      {{"pool-bytes", "256KiB"}, {"chunk-bytes", "64KiB"}, {"checksum-block-bytes", "256KiB"}});
  Buf a({700, 333}, 5);
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  REQUIRE(rt->save_async(sd, 1).wait_committed().ok());
  Buf b({700, 333}, 6);
  ferry::StateDict out;
  REQUIRE(out.add("a", b.view()).ok());
  REQUIRE(rt->load(out, dir.path()).ok());
  CHECK(a.bytes == b.bytes);
}

TEST_CASE("a resharded load reads only the blocks it needs", "[actors][load][reshard]") {
  const std::string base = GENERATE(std::string("/dev/shm"), disk_base());
  ScratchDir dir(base);
  auto cfs = std::make_shared<CountingFs>();
  auto rt = make_runtime(dir.path(), cfs);
  // 1024 x 1024 f32: 4 MiB, one 64 KiB checksum block per 16 rows.
  const int64_t R = 1024, C = 1024;
  Buf w({R, C}, 1), other({R, C}, 2);
  ferry::StateDict sd;
  REQUIRE(sd.add("w", w.view()).ok());
  REQUIRE(sd.add("x", other.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  const ferry::Manifest m = read_manifest(h.path());
  const uint64_t header = m.files.at(0).header_bytes;

  // Rows [100, 300) lie in blocks 6..18: 13 blocks.
  const int64_t r0 = 100, rows = 200;
  std::vector<float> piece(rows * C);
  ferry::StateDict out;
  REQUIRE(out.add("w", {piece.data(), ferry::DType::f32, {rows, C}}, ferry::Shard{{R, C}, {r0, 0}})
              .ok());
  cfs->reset();
  REQUIRE(rt->load(out, h.path()).ok());
  REQUIRE(std::memcmp(piece.data(), w.bytes.data() + r0 * C * 4, piece.size() * 4) == 0);
  const uint64_t needed = 13 * (64 << 10);
  const uint64_t read = cfs->counts->bytes_read;
  INFO("read " << read << " bytes; the blocks needed hold " << needed << ", the header " << header);
  CHECK(read >= needed);
  // The header once per reader, and at most a page of alignment at each end
  // of a run (runs are at most one 256 KiB pool block: 4 of them here).
  CHECK(read <= needed + 2 * ((header + 4095) / 4096 * 4096) + 4 * 2 * 4096);
}

TEST_CASE("corruption in one block is detected and named", "[actors][load][corruption]") {
  const std::string base = GENERATE(std::string("/dev/shm"), disk_base());
  ScratchDir dir(base);
  auto rt = make_runtime(dir.path(), nullptr);
  Buf a({512, 512}, 1), b({300, 77}, 2);  // 1 MiB: 16 blocks of 64 KiB
  ferry::StateDict sd;
  REQUIRE(sd.add("layers.0.weight", a.view()).ok());
  REQUIRE(sd.add("layers.1.bias", b.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  const ferry::Manifest m = read_manifest(h.path());
  const ferry::ManifestTensor* t = m.find("layers.0.weight");
  REQUIRE(t);
  const uint64_t at = t->chunks.at(0).byte_offset + 5 * (64 << 10) + 1234;  // in block 5
  const std::string data = data_file(h.path());
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x21;
    f.seekp(at);
    f.write(&c, 1);
  }
  evict(data);

  SECTION("the whole tensor") {
    Buf o({512, 512}, 3), p({300, 77}, 4);
    ferry::StateDict out;
    REQUIRE(out.add("layers.0.weight", o.view()).ok());
    REQUIRE(out.add("layers.1.bias", p.view()).ok());
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("layers.0.weight"));
    CHECK_THAT(st.message(), Catch::Contains("block 5"));
    CHECK_THAT(st.message(), Catch::Contains("rank 0"));
    CHECK_THAT(st.message(), Catch::Contains(fs::path(data).filename().string()));
    // The damaged block landed before its sum failed; the other tensor holds
    // only bytes that passed.
    CHECK_THAT(st.message(),
               Catch::EndsWith("(unverified bytes were left in tensor 'layers.0.weight')"));
  }
  SECTION("a shard that takes part of the block gets no byte before the block checked out") {
    // Columns [0, 256): half of every row of block 5, copied only once it passed.
    std::vector<float> cols(512 * 256, -1.0f);
    ferry::StateDict out;
    REQUIRE(out.add("layers.0.weight", {cols.data(), ferry::DType::f32, {512, 256}},
                    ferry::Shard{{512, 512}, {0, 0}})
                .ok());
    auto st = rt->load(out, h.path());
    CHECK(st.code() == ferry::StatusCode::corruption);
    CHECK_THAT(st.message(), Catch::Contains("block 5"));
    CHECK_THAT(st.message(), !Catch::Contains("unverified"));
  }
  SECTION("a shard that does not touch the block loads") {
    // Rows [0, 64) are blocks 0..1; the flipped byte is in block 5.
    std::vector<float> rows(64 * 512);
    ferry::StateDict out;
    REQUIRE(out.add("layers.0.weight", {rows.data(), ferry::DType::f32, {64, 512}},
                    ferry::Shard{{512, 512}, {0, 0}})
                .ok());
    REQUIRE(rt->load(out, h.path()).ok());
    CHECK(std::memcmp(rows.data(), a.bytes.data(), rows.size() * 4) == 0);
  }
}

TEST_CASE("a load from disk leaves the checkpoint out of the page cache", "[actors][load][cache]") {
  ScratchDir dir(disk_base());
  REQUIRE(!dir.path().empty());
  if (!takes_direct(dir.path())) {
    FERRY_SKIP(dir.path() << " does not take O_DIRECT; set FERRY_TEST_DISK_DIR to a disk");
  }
  const std::string direct_io = GENERATE(std::string("true"), std::string("false"));
  INFO("direct-io = " << direct_io);
  auto rt =
      make_runtime(dir.path(), nullptr,
                   {{"direct-io", direct_io}, {"pool-bytes", "8MiB"}, {"chunk-bytes", "1MiB"}});
  std::vector<Buf> bufs;
  ferry::StateDict sd;
  for (int i = 0; i < 8; ++i) bufs.emplace_back(std::vector<int64_t>{1000 + i, 1024}, i);
  for (int i = 0; i < 8; ++i) REQUIRE(sd.add("t" + std::to_string(i), bufs[i].view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  const std::string data = data_file(h.path());
  evict(data);
  const auto before = resident_pages(data);
  INFO("resident before the load: " << before.first << " of " << before.second << " pages");

  std::vector<Buf> outs;
  ferry::StateDict out;
  for (int i = 0; i < 8; ++i) outs.emplace_back(bufs[i].shape, 50 + i);
  for (int i = 0; i < 8; ++i) REQUIRE(out.add("t" + std::to_string(i), outs[i].view()).ok());
  REQUIRE(rt->load(out, h.path()).ok());
  for (int i = 0; i < 8; ++i) REQUIRE(outs[i].bytes == bufs[i].bytes);
  const auto after = resident_pages(data);
  INFO("resident after the load: " << after.first << " of " << after.second << " pages");
  // A buffered whole-file read would leave every page; allow the header and
  // stragglers of readahead.
  CHECK(after.first <= after.second / 20 + 16);
}

namespace {

// What /proc/self/smaps says of the mappings that overlap [p, p + n): the
// bytes in anonymous huge pages, and whether any is flagged for them (hg).
struct HugeState {
  uint64_t huge_bytes = 0;
  bool flagged = false;
};

HugeState huge_state(const void* p, size_t n) {
  const auto lo = reinterpret_cast<uintptr_t>(p);
  const auto hi = lo + n;
  std::ifstream smaps("/proc/self/smaps");
  REQUIRE(smaps);
  HugeState s;
  bool in = false;
  std::string line;
  while (std::getline(smaps, line)) {
    unsigned long a = 0, b = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> a >> dash >> b && dash == '-' && line.find(':') > line.find(' ')) {
      in = a < hi && lo < b;
    } else if (in && line.rfind("AnonHugePages:", 0) == 0) {
      s.huge_bytes += std::stoull(line.substr(14)) * 1024;
    } else if (in && line.rfind("VmFlags:", 0) == 0) {
      s.flagged = s.flagged || line.find(" hg") != std::string::npos;
    }
  }
  return s;
}

std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace

// A first load fills tensors just allocated; faulting them in 4 KiB pages
// took most of its time. Where the kernel gives huge pages on request, the
// load asks for them, whether it reads straight into the tensor (offset 0,
// page-aligned) or copies out of a staging block (offset 64, as torch's
// allocator leaves it), and leaves memory already in use as it was.
TEST_CASE("a load into memory just allocated faults it in huge pages where given on request",
          "[actors][load][huge]") {
  if (thp_mode().find("[madvise]") == std::string::npos)
    FERRY_SKIP("transparent huge pages are not in madvise mode: " << thp_mode());
  ScratchDir dir(disk_base());
  REQUIRE(!dir.path().empty());
  const size_t offset = GENERATE(size_t{0}, size_t{64});
  INFO("tensor at offset " << offset << " of its mapping");
  auto rt = make_runtime(dir.path(), nullptr, {{"pool-bytes", "8MiB"}});
  Buf a({3 << 10, 1 << 10}, 7);  // 12 MiB
  ferry::StateDict sd;
  REQUIRE(sd.add("a", a.view()).ok());
  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());
  evict(data_file(h.path()));

  const size_t n = a.bytes.size();
  const size_t mapped = n + offset + 4096;
  auto map = [&] {
    void* m = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(m != MAP_FAILED);
    return static_cast<uint8_t*>(m);
  };
  SECTION("fresh memory") {
    uint8_t* m = map();
    ferry::StateDict out;
    REQUIRE(out.add("a", {m + offset, ferry::DType::f32, a.shape}).ok());
    REQUIRE(rt->load(out, h.path()).ok());
    CHECK(std::memcmp(m + offset, a.bytes.data(), n) == 0);
    const HugeState s = huge_state(m, mapped);
    // 12 MiB hold at least five whole huge pages wherever the mapping starts.
    CHECK(s.huge_bytes >= (5u << 21));
    CHECK(s.flagged);
    ::munmap(m, mapped);
  }
  SECTION("memory in use") {
    uint8_t* m = map();
    std::memset(m, 1, mapped);
    ferry::StateDict out;
    REQUIRE(out.add("a", {m + offset, ferry::DType::f32, a.shape}).ok());
    REQUIRE(rt->load(out, h.path()).ok());
    CHECK(std::memcmp(m + offset, a.bytes.data(), n) == 0);
    CHECK(!huge_state(m, mapped).flagged);
    ::munmap(m, mapped);
  }
}
