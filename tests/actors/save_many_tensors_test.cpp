// A save of many small tensors costs per block, not per tensor, where the
// bytes go: one pwrite per block of a data file whatever the tensor count,
// one copy per tensor (plus one per block boundary a tensor straddles), and
// a failed copy still names its tensor.

#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "test_util.hpp"

using ferry::testing::TempDir;

namespace {

// The pwrites of every data file, by path.
struct WriteCounts {
  std::mutex mu;
  std::map<std::string, uint64_t> by_path;
};

class CountedFile : public ferry::File {
 public:
  CountedFile(std::unique_ptr<ferry::File> f, WriteCounts* counts)
      : f_(std::move(f)), counts_(counts) {}
  const std::string& path() const override { return f_->path(); }
  bool direct() const override { return f_->direct(); }
  ferry::Status pwrite(const void* data, size_t len, uint64_t offset) override {
    {
      std::lock_guard<std::mutex> lock(counts_->mu);
      ++counts_->by_path[f_->path()];
    }
    return f_->pwrite(data, len, offset);
  }
  ferry::Result<size_t> pread(void* data, size_t len, uint64_t offset) override {
    return f_->pread(data, len, offset);
  }
  ferry::Status truncate(uint64_t size) override { return f_->truncate(size); }
  ferry::Status reserve(uint64_t size) override { return f_->reserve(size); }
  ferry::Status sync() override { return f_->sync(); }
  ferry::Status close() override { return f_->close(); }

 private:
  std::unique_ptr<ferry::File> f_;
  WriteCounts* counts_;
};

class CountingFs : public ferry::FilesystemWrapper {
 public:
  explicit CountingFs(WriteCounts* counts)
      : FilesystemWrapper(ferry::posix_filesystem()), counts_(counts) {}
  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    auto f = target_->open(p, o);
    if (!f.ok() || !o.write || p.find(".safetensors") == std::string::npos) return f;
    return std::unique_ptr<ferry::File>(new CountedFile(std::move(f).value(), counts_));
  }

 private:
  WriteCounts* counts_;
};

// Host copies, counted; a copy from `fail_at` fails (as a device error would).
class CountingDevice : public ferry::DeviceBackend {
 public:
  bool handles(const ferry::Device& d) const override { return d.is_host(); }
  void copy_out(const ferry::TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override {
    ++copies;
    if (src.data == fail_at) return done(ferry::Status::io_error("injected copy error"));
    ferry::strided_copy_out(src, offset, len, dst);
    done(ferry::Status());
  }
  void copy_in(const void* src, const ferry::TensorView& dst, uint64_t offset, uint64_t len,
               Done done) override {
    ferry::strided_copy_in(src, dst, offset, len);
    done(ferry::Status());
  }
  std::atomic<uint64_t> copies{0};
  const void* fail_at = nullptr;
};

constexpr uint64_t kChunk = 64 * 1024;

// `n` f32 tensors of 64 to 1,088 elements, each filled from its index.
std::vector<std::vector<float>> make_tensors(size_t n) {
  std::vector<std::vector<float>> ts(n);
  for (size_t i = 0; i < n; ++i) {
    ts[i].resize(64 + (i * 7919) % 1025);
    for (size_t k = 0; k < ts[i].size(); ++k) ts[i][k] = static_cast<float>(i * 10000 + k);
  }
  return ts;
}

ferry::StateDict state_of(std::vector<std::vector<float>>& ts) {
  ferry::StateDict sd;
  for (size_t i = 0; i < ts.size(); ++i)
    REQUIRE(sd.add("layers." + std::to_string(i) + ".weight",
                   {ts[i].data(), ferry::DType::f32, {static_cast<int64_t>(ts[i].size())}})
                .ok());
  return sd;
}

std::unique_ptr<ferry::Runtime> runtime(const std::string& root,
                                        std::shared_ptr<ferry::Filesystem> fs,
                                        std::shared_ptr<ferry::DeviceBackend> device) {
  ferry::RuntimeArgs args;
  // The pool holds a fraction of the state: the snapshot streams through it.
  args.set("root", root).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
  args.set("copy-threads", "2").set("writers", "2").set("direct-io", "false");
  args.set("fsync", "false");
  args.fs = std::move(fs);
  args.device = std::move(device);
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  return std::move(rt).value();
}

}  // namespace

TEST_CASE("many small tensors: one pwrite per block of each data file, one copy per piece",
          "[actors][save][many_tensors]") {
  TempDir dir;
  auto ts = make_tensors(3000);  // about 6.6 MiB
  ferry::StateDict sd = state_of(ts);
  WriteCounts counts;
  auto device = std::make_shared<CountingDevice>();
  auto rt = runtime(dir.path(), std::make_shared<CountingFs>(&counts), device);

  auto h = rt->save_async(sd, 1);
  REQUIRE(h.wait_committed().ok());

  uint64_t blocks = 0, files = 0;
  for (const auto& e : std::filesystem::directory_iterator(h.path())) {
    const std::string name = e.path().filename().string();
    if (name.find(".safetensors") == std::string::npos) continue;
    ++files;
    const uint64_t size = std::filesystem::file_size(e.path());
    const uint64_t file_blocks = (size + kChunk - 1) / kChunk;
    blocks += file_blocks;
    uint64_t writes = 0;
    {
      std::lock_guard<std::mutex> lock(counts.mu);
      for (const auto& [path, n] : counts.by_path)
        if (std::filesystem::path(path).filename() == name) writes = n;
    }
    INFO(name << ": " << size << " bytes");
    CHECK(writes == file_blocks);
  }
  REQUIRE(files >= 1);
  REQUIRE(blocks > 100);
  // A copy per tensor, and one more for each tensor cut by a block's end.
  CHECK(device->copies.load() >= ts.size());
  CHECK(device->copies.load() < ts.size() + blocks);

  auto back = make_tensors(3000);
  for (auto& t : back) std::fill(t.begin(), t.end(), -1.0f);
  ferry::StateDict out = state_of(back);
  REQUIRE(rt->load(out, h.path()).ok());
  for (size_t i = 0; i < ts.size(); ++i) {
    INFO("tensor " << i);
    REQUIRE(std::memcmp(back[i].data(), ts[i].data(), ts[i].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("many small tensors: a failed copy names its tensor, the next save works",
          "[actors][save][many_tensors]") {
  TempDir dir;
  auto ts = make_tensors(3000);
  ferry::StateDict sd = state_of(ts);
  WriteCounts counts;
  auto device = std::make_shared<CountingDevice>();
  device->fail_at = ts[2345].data();  // in a late block, with the pool recycled before it
  auto rt = runtime(dir.path(), std::make_shared<CountingFs>(&counts), device);

  const ferry::Status st = rt->save_async(sd, 1).wait_committed();
  REQUIRE_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains("tensor 'layers.2345.weight'") &&
                               Catch::Contains("injected copy error"));

  device->fail_at = nullptr;
  auto h = rt->save_async(sd, 2);
  REQUIRE(h.wait_committed().ok());
  auto back = make_tensors(3000);
  for (auto& t : back) std::fill(t.begin(), t.end(), -1.0f);
  ferry::StateDict out = state_of(back);
  REQUIRE(rt->load(out, h.path()).ok());
  for (size_t i = 0; i < ts.size(); ++i) {
    INFO("tensor " << i);
    REQUIRE(std::memcmp(back[i].data(), ts[i].data(), ts[i].size() * sizeof(float)) == 0);
  }
}
