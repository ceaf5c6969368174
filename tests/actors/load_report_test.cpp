// Load through the Runtime: what the load report says, and that a load ends
// with an error, never a hang, when a reader dies under it.

#include <catch2/catch.hpp>

#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <new>
#include <optional>
#include <stdexcept>
#include <thread>

#include "ferry/device.hpp"
#include "ferry/runtime.hpp"
#include "runtime_rig.hpp"
#include "test_util.hpp"

using ferry::testing::TempDir;

namespace {

std::unique_ptr<ferry::Runtime> make_runtime(const std::string& root,
                                             std::shared_ptr<ferry::DeviceBackend> device = {}) {
  return ferry::testing::make_test_runtime(root, {{}, nullptr, std::move(device)});
}

// 4x4 f32 tensors whose bytes depend on `seed`.
struct Tensors {
  std::vector<std::vector<float>> data;
  ferry::StateDict sd;
  Tensors(const std::vector<std::string>& keys, float seed) {
    data.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      data.emplace_back(16);
      for (size_t j = 0; j < 16; ++j) data[i][j] = seed * 100 + static_cast<float>(i * 16 + j);
      REQUIRE(sd.add(keys[i], ferry::TensorView(data[i].data(), ferry::DType::f32, {4, 4})).ok());
    }
  }
};

// What this process writes to stderr while it is alive.
class StderrCapture {
 public:
  explicit StderrCapture(const std::string& path) : path_(path) {
    std::fflush(stderr);
    saved_ = dup(2);
    FILE* f = std::fopen(path.c_str(), "w");
    REQUIRE(f != nullptr);
    dup2(fileno(f), 2);
    std::fclose(f);
  }
  ~StderrCapture() { restore(); }
  std::string text() {
    restore();
    std::ifstream in(path_);
    return {std::istreambuf_iterator<char>(in), {}};
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    saved_ = -1;
  }
  std::string path_;
  int saved_ = -1;
};

// The host device, except that copying into a tensor throws: the reader
// doing the copy dies (or, with `no_memory`, finds memory ran out).
class ThrowingCopyIn : public ferry::DeviceBackend {
 public:
  explicit ThrowingCopyIn(bool no_memory = false) : no_memory_(no_memory) {}
  bool handles(const ferry::Device& d) const override { return host_->handles(d); }
  void copy_out(const ferry::TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override {
    host_->copy_out(src, offset, len, dst, std::move(done));
  }
  void copy_in(const void*, const ferry::TensorView&, uint64_t, uint64_t, Done) override {
    if (no_memory_) throw std::bad_alloc();
    throw std::runtime_error("copy_in failed on purpose");
  }

 private:
  bool no_memory_;
  std::shared_ptr<ferry::DeviceBackend> host_ = ferry::host_device();
};

}  // namespace

TEST_CASE("a load report lists the checkpoint tensors the state dict left out", "[actors][load]") {
  TempDir dir;
  auto rt = make_runtime(dir.path());
  Tensors saved({"a.w", "b.w", "c.w", "d.w"}, 1);
  auto h = rt->save_async(saved.sd, 5);
  REQUIRE(h.wait_committed().ok());

  Tensors some({"c.w", "a.w"}, 2);
  std::string log;
  std::optional<ferry::Result<ferry::LoadReport>> got;
  {
    StderrCapture capture(dir.sub("stderr.txt"));
    got.emplace(rt->load_report(some.sd, dir.path()));
    log = capture.text();
  }
  const auto& r = *got;
  REQUIRE(r.ok());
  CHECK(r->path == h.path());
  CHECK(r->step == 5);
  CHECK(r->tensors_restored == 2);
  CHECK(r->not_restored == std::vector<std::string>{"b.w", "d.w"});
  CHECK(r->bytes_read == 2 * 16 * sizeof(float));
  CHECK(some.data[0] == saved.data[2]);
  CHECK(some.data[1] == saved.data[0]);
  // The report is the caller's to show; a plain load says it on stderr.
  CHECK(log.find("not restored") == std::string::npos);
  Tensors again({"c.w", "a.w"}, 2);
  {
    StderrCapture capture(dir.sub("stderr2.txt"));
    REQUIRE(rt->load(again.sd, dir.path()).ok());
    log = capture.text();
  }
  CHECK_THAT(log, Catch::Contains("not restored") && Catch::Contains("b.w, d.w") &&
                      Catch::Contains("step 5"));

  Tensors all({"a.w", "b.w", "c.w", "d.w"}, 3);
  auto full = rt->load_report(all.sd, h.path());
  REQUIRE(full.ok());
  CHECK(full->not_restored.empty());
  CHECK(full->tensors_restored == 4);
  // The plain load keeps working, and a key the checkpoint lacks is an error naming it.
  Tensors fewer({"d.w"}, 4);
  CHECK(rt->load(fewer.sd, dir.path()).ok());
  Tensors stranger({"a.w", "e.w"}, 5);
  auto missing = rt->load_report(stranger.sd, dir.path());
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(missing.status().message(), Catch::Contains("e.w"));
}

TEST_CASE("a reader that dies fails the load instead of hanging it", "[actors][load]") {
  TempDir dir;
  std::unique_ptr<ferry::Runtime> rt = make_runtime(dir.path(), std::make_shared<ThrowingCopyIn>());
  auto tensors = std::make_shared<Tensors>(std::vector<std::string>{"a.w", "b.w", "c.w"}, 1);
  REQUIRE(rt->save_async(tensors->sd, 1).wait_committed().ok());

  for (int attempt = 0; attempt < 2; ++attempt) {
    INFO("load " << attempt);  // the second finds the readers replaced
    auto done = std::make_shared<std::promise<ferry::Status>>();
    auto result = done->get_future();
    ferry::Runtime* r = rt.get();
    std::thread([r, tensors, done, root = dir.path()] {
      done->set_value(r->load(tensors->sd, root));
    }).detach();
    if (result.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
      // The hung load still uses the runtime and the tensors: leave them be.
      rt.release();
      FAIL("load did not return within 30 s after its reader died");
    }
    const ferry::Status st = result.get();
    CHECK(st.code() == ferry::StatusCode::internal);
    CHECK_THAT(st.message(), Catch::Contains("reader"));
  }
}

TEST_CASE("memory that runs out in a reader fails the load with a message, not the reader",
          "[actors][load]") {
  TempDir dir;
  std::unique_ptr<ferry::Runtime> rt =
      make_runtime(dir.path(), std::make_shared<ThrowingCopyIn>(true));
  Tensors tensors({"a.w", "b.w", "c.w"}, 1);
  auto h = rt->save_async(tensors.sd, 1);
  REQUIRE(h.wait_committed().ok());
  const ferry::Status st = rt->load(tensors.sd, dir.path());
  INFO(st.to_string());
  CHECK(st.code() == ferry::StatusCode::internal);
  CHECK_THAT(st.message(), Catch::Contains("out of memory reading the data files of " + h.path()));
}
