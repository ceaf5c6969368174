// Storage faults under a running Runtime: the fault-injecting filesystem
// wraps the real one, so every error comes from a real code path.

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "ferry/runtime.hpp"
#include "test_util.hpp"
#include "verify.hpp"

namespace fs = std::filesystem;
using ferry::testing::TempDir;

namespace {

struct Model {
  std::vector<float> a, b;
  ferry::StateDict sd;
  explicit Model(float seed) : a(300 * 100), b(777) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = seed + static_cast<float>(i);
    for (size_t i = 0; i < b.size(); ++i) b[i] = seed * 2 - static_cast<float>(i);
    REQUIRE(sd.add("enc.weight", {a.data(), ferry::DType::f32, {300, 100}}).ok());
    REQUIRE(sd.add("enc.bias", {b.data(), ferry::DType::f32, {777}}).ok());
  }
};

std::unique_ptr<ferry::Runtime> runtime(const std::string& root,
                                        std::shared_ptr<ferry::Filesystem> fsys) {
  ferry::RuntimeArgs args;
  args.set("root", root).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  args.set("checksum-block-bytes", "16KiB");
  args.fs = std::move(fsys);
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  return std::move(rt).value();
}

bool loads_as(ferry::Runtime& rt, const std::string& root, float seed) {
  Model want(seed), got(-1);
  if (!rt.load(got.sd, root).ok()) return false;
  return got.a == want.a && got.b == want.b;
}

void flip(const std::string& path, uint64_t off) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(off));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(off));
  f.write(&c, 1);
}

// A runtime on the fault filesystem, with Model(1) committed as step 1.
struct Faulty {
  TempDir dir;
  std::shared_ptr<ferry::FaultFilesystem> faults =
      std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
  std::unique_ptr<ferry::Runtime> rt = runtime(dir.path(), faults);
  std::string before;
  Faulty() {
    Model m1(1);
    REQUIRE(rt->save_async(m1.sd, 1).wait_committed().ok());
    before = rt->latest();
  }
  // After a failed save: step 1 is untouched and still the latest, and no
  // pending directory is left.
  void check_untouched() {
    CHECK(rt->latest() == before);
    CHECK(loads_as(*rt, dir.path(), 1));
    for (auto& e : fs::directory_iterator(dir.path()))
      CHECK_FALSE(ferry::is_pending_dir_name(e.path().filename().string()));
  }
};

}  // namespace

TEST_CASE("ENOSPC and EIO at every operation kind fail the save cleanly", "[actors][faults]") {
  using Op = ferry::FaultOp;
  const std::pair<Op, const char*> kinds[] = {
      {Op::open, "open"},     {Op::write, "pwrite"}, {Op::sync, "fsync"},
      {Op::rename, "rename"}, {Op::mkdir, "mkdir"},  {Op::truncate, "truncate"},
  };
  for (int err : {ENOSPC, EIO}) {
    for (const auto& [op, opname] : kinds) {
      Faulty t;
      const std::string dir = t.dir.path();
      auto& faults = t.faults;
      auto& rt = t.rt;
      ferry::FaultRule rule;
      rule.op = op;
      rule.error = err;
      rule.nth = 1;
      faults->add_rule(rule);
      Model m2(2);
      auto h = rt->save_async(m2.sd, 2);
      const ferry::Status st = h.wait_committed();
      INFO(ferry::fault_op_name(op) << " errno " << err << ": " << st.to_string());
      CHECK_FALSE(st.ok());
      CHECK_THAT(st.message(), Catch::Contains("(injected)"));
      CHECK_THAT(st.message(), Catch::Contains(dir));
      t.check_untouched();

      // The fault gone, training goes on and the next save works.
      faults->clear_rules();
      REQUIRE(rt->save_async(m2.sd, 3).wait_committed().ok());
      CHECK(loads_as(*rt, dir, 2));
    }
  }
}

TEST_CASE("a disk too full for a save fails it as its files are allocated, before any write",
          "[actors][faults]") {
  Faulty t;
  const std::string dir = t.dir.path();
  auto& faults = t.faults;
  auto& rt = t.rt;
  // The 1st size change of a data file is its allocation, the 2nd the cut
  // to its length after the last write.
  for (uint64_t nth : {1, 2}) {
    ferry::FaultRule rule;
    rule.op = ferry::FaultOp::truncate;
    rule.error = ENOSPC;
    rule.nth = nth;
    rule.path_contains = ".safetensors";
    faults->add_rule(rule);
    Model m2(2);
    auto h = rt->save_async(m2.sd, 2);
    const ferry::Status st = h.wait_committed();
    INFO(st.to_string());
    CHECK(st.code() == ferry::StatusCode::io_error);
    CHECK_THAT(st.message(), Catch::Contains(nth == 1 ? "fallocate" : "truncate"));
    CHECK_THAT(st.message(), Catch::Contains(".safetensors"));
    CHECK_THAT(st.message(), Catch::Contains("No space left"));
    // Found before the first block: nothing of the save was written.
    if (nth == 1) CHECK(h.bytes_persisted() == 0);
    t.check_untouched();
    faults->clear_rules();
  }
  Model m3(3);
  REQUIRE(rt->save_async(m3.sd, 3).wait_committed().ok());
  CHECK(loads_as(*rt, dir, 3));
}

TEST_CASE("a disk that fills mid-write (short write) fails the save", "[actors][faults]") {
  TempDir dir;
  auto faults = std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
  auto rt = runtime(dir.path(), faults);
  Model m1(1);
  REQUIRE(rt->save_async(m1.sd, 1).wait_committed().ok());
  ferry::FaultRule rule;
  rule.action = ferry::FaultRule::Action::short_write;
  rule.op = ferry::FaultOp::write;
  rule.nth = 2;
  rule.sticky = true;  // stays full
  faults->add_rule(rule);
  Model m2(2);
  auto st = rt->save_async(m2.sd, 2).wait_committed();
  CHECK(st.code() == ferry::StatusCode::io_error);
  CHECK_THAT(st.message(), Catch::Contains("No space left"));
  CHECK(loads_as(*rt, dir.path(), 1));
}

TEST_CASE("bit flips and truncations anywhere are always detected", "[actors][corruption]") {
  TempDir dir;
  auto rt = runtime(dir.path(), ferry::posix_filesystem());
  Model m(3);
  auto h = rt->save_async(m.sd, 1);
  REQUIRE(h.wait_committed().ok());
  const std::string ckpt = h.path();
  std::vector<std::string> files;
  for (auto& e : fs::directory_iterator(ckpt)) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  // Keep pristine copies to restore between trials.
  std::map<std::string, std::string> pristine;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    pristine[f] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  auto restore = [&] {
    for (const auto& [f, bytes] : pristine) {
      std::ofstream out(f, std::ios::binary | std::ios::trunc);
      out << bytes;
    }
  };
  std::mt19937_64 rng(42);
  int trials = 0, by_load = 0, by_verify = 0;
  for (const auto& f : files) {
    const uint64_t size = pristine[f].size();
    for (int i = 0; i < 60; ++i) {
      const bool truncate = i % 10 == 9;
      if (truncate)
        fs::resize_file(f, rng() % size);
      else
        flip(f, rng() % size);
      ++trials;
      Model got(-1);
      by_load += !rt->load(got.sd, ckpt).ok();
      auto rep = ferry::verify_checkpoint(*ferry::posix_filesystem(), ckpt);
      by_verify += !rep.ok() || !rep->ok();
      restore();
    }
  }
  INFO(trials << " trials over " << files.size() << " files");
  CHECK(by_load == trials);
  CHECK(by_verify == trials);
  CHECK(loads_as(*rt, dir.path(), 3));  // restored: intact again
}
