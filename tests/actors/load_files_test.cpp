// A data file a load cannot open (missing, refused with EIO, a FIFO, or
// deleted while the load reads the step) fails the load, and an export,
// with an error that names the file and the OS error; the process goes on.

#include <sys/stat.h>
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "ferry/export.hpp"
#include "ferry/runtime.hpp"
#include "manifest.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::TempDir;

namespace {

struct Model {
  std::vector<float> a, b;
  ferry::StateDict sd;
  explicit Model(float seed) : a(300 * 100), b(777) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = seed + static_cast<float>(i);
    for (size_t i = 0; i < b.size(); ++i) b[i] = seed * 2 - static_cast<float>(i);
    if (!sd.add("enc.weight", {a.data(), ferry::DType::f32, {300, 100}}).ok() ||
        !sd.add("enc.bias", {b.data(), ferry::DType::f32, {777}}).ok())
      throw std::logic_error("Model: the state dict refused its own keys");
  }
};

// As retention would while a load reads the step: once the load opens the
// first data file, every other data file of the step is gone.
class DeletingFs : public ferry::FilesystemWrapper {
 public:
  using FilesystemWrapper::FilesystemWrapper;
  bool armed = false;
  int deleted = 0;
  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    auto f = target_->open(p, o);
    if (armed && !o.write && p.find("-0000.safetensors") != std::string::npos) {
      armed = false;
      const fs::path dir = fs::path(p).parent_path();
      for (auto& e : fs::directory_iterator(dir))
        if (e.path().extension() == ".safetensors" && e.path().string() != p &&
            target_->unlink(e.path().string()).ok())
          ++deleted;
    }
    return f;
  }
};

std::unique_ptr<ferry::Runtime> runtime(const std::string& root,
                                        std::shared_ptr<ferry::Filesystem> fsys) {
  ferry::RuntimeArgs args;
  args.set("root", root).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  // Several data files per rank: a load opens them one by one.
  args.set("checksum-block-bytes", "16KiB").set("shard-size", "64KiB").set("readers", "1");
  args.fs = std::move(fsys);
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  return std::move(rt).value();
}

std::vector<std::string> data_files(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("a data file that cannot be opened fails the load and the export, naming it",
          "[actors][load][files]") {
  TempDir dir;
  auto faults = std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
  auto deleting = std::make_shared<DeletingFs>(faults);
  auto rt = runtime(dir.path(), deleting);
  Model saved(1);
  auto h = rt->save_async(saved.sd, 1);
  REQUIRE(h.wait_committed().ok());
  const std::string step = h.path();
  const auto files = data_files(step);
  REQUIRE(files.size() >= 2);
  const std::string victim = files[1];

  const char* how = GENERATE("missing", "eio", "fifo", "deleted while loading");
  INFO(how);
  std::string expect_error;
  if (std::string(how) == "missing") {
    fs::remove(victim);
    expect_error = "No such file or directory";
  } else if (std::string(how) == "eio") {
    ferry::FaultRule rule;
    rule.op = ferry::FaultOp::open;
    rule.error = EIO;
    rule.sticky = true;
    rule.nth = 1;
    rule.path_contains = fs::path(victim).filename().string();
    faults->add_rule(rule);
    expect_error = "Input/output error";
  } else if (std::string(how) == "fifo") {
    fs::remove(victim);
    REQUIRE(::mkfifo(victim.c_str(), 0600) == 0);
    expect_error = "not a regular file";
  } else {
    expect_error = "No such file or directory";
  }

  for (const bool to_export : {false, true}) {
    INFO((to_export ? "export" : "load"));
    // The first reader of the step deletes the others' files; later ones find them gone.
    deleting->armed = std::string(how) == "deleted while loading";
    ferry::Status s;
    const std::string out = dir.sub("export");
    if (to_export) {
      s = ferry::export_checkpoint(*rt, step, out).status();
    } else {
      Model got(-1);
      s = rt->load(got.sd, step);
    }
    INFO(s.to_string());
    CHECK_FALSE(s.ok());
    CHECK_THAT(s.message(), Catch::Contains(victim) && Catch::Contains(expect_error));
    if (std::string(how) == "deleted while loading") CHECK(deleting->deleted > 0);
    if (to_export && fs::exists(out))
      for (auto& e : fs::directory_iterator(out)) FAIL("export left " << e.path());
  }

  // The runtime stays usable: the next load of a whole step succeeds.
  faults->clear_rules();
  Model next(5);
  REQUIRE(rt->save_async(next.sd, 9).wait_committed().ok());
  Model got(-1);
  REQUIRE(rt->load(got.sd, dir.path()).ok());
  CHECK(got.a == next.a);
  CHECK(got.b == next.b);
}

TEST_CASE("a crafted manifest's frame size is refused before a load or export takes memory for it",
          "[actors][load][files]") {
  TempDir dir;
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  args.set("compress", "zstd");
  auto created = ferry::Runtime::create(args);
  REQUIRE(created.ok());
  auto rt = std::move(created).value();
  Model saved(1);
  auto h = rt->save_async(saved.sd, 1);
  REQUIRE(h.wait_committed().ok());
  const std::string step = h.path();

  // Each compressed chunk as one frame of 64 GiB: its raw bytes (64 KiB at
  // most) still tile it, so only the frame size itself is wrong. A reader
  // that sized its decoding by the frame ran out of memory here.
  auto m = ferry::read_manifest(*ferry::posix_filesystem(), step);
  REQUIRE(m.ok());
  int crafted = 0;
  for (auto& t : m->tensors)
    for (auto& c : t.chunks)
      if (!c.codec.empty()) {
        c.frame_bytes = 64ull << 30;
        c.frame_ends = {c.byte_length};
        ++crafted;
      }
  REQUIRE(crafted > 0);
  {
    std::ofstream out(step + "/" + ferry::kManifestFileName, std::ios::binary | std::ios::trunc);
    out << ferry::encode_manifest(*m);
  }

  Model got(-1);
  const ferry::Status s = rt->load(got.sd, step);
  INFO(s.to_string());
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.message(), Catch::Contains("enc.") && Catch::Contains("frame size 68719476736"));
  const auto e = ferry::export_checkpoint(*rt, step, dir.sub("export"));
  INFO(e.status().to_string());
  CHECK_THAT(e.status().message(), Catch::Contains("enc.") && Catch::Contains("frame size"));
}

TEST_CASE("a crafted manifest's header size is capped by the data file's real length",
          "[actors][load][files]") {
  TempDir dir;
  auto rt = runtime(dir.path(), ferry::posix_filesystem());
  Model saved(1);
  auto h = rt->save_async(saved.sd, 1);
  REQUIRE(h.wait_committed().ok());
  const std::string step = h.path();

  // The manifest says the first file is 64 GiB with a 32 GiB header; it is
  // a few KiB. A reader that believed it asked for 32 GiB for the header.
  auto m = ferry::read_manifest(*ferry::posix_filesystem(), step);
  REQUIRE(m.ok());
  REQUIRE(m->files.at(0).header_bytes > 0);
  m->files[0].size = 64ull << 30;
  m->files[0].header_bytes = 32ull << 30;
  {
    std::ofstream out(step + "/" + ferry::kManifestFileName, std::ios::binary | std::ios::trunc);
    out << ferry::encode_manifest(*m);
  }
  Model got(-1);
  const ferry::Status s = rt->load(got.sd, step);
  INFO(s.to_string());
  CHECK(s.code() == ferry::StatusCode::corruption);
  CHECK_THAT(s.message(), Catch::Contains(step + "/" + m->files[0].name) &&
                              Catch::Contains("shorter than its safetensors header"));
}
