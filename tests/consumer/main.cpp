// Includes every public header and nothing else, then saves and loads a small
// state dict through the public API: proof that the installed headers are
// self-contained and that Ferry::ferry links and runs on its own.
#include <ferry/catalog.hpp>
#include <ferry/device.hpp>
#include <ferry/export.hpp>
#include <ferry/export_macro.hpp>
#include <ferry/filesystem.hpp>
#include <ferry/load_report.hpp>
#include <ferry/logger.hpp>
#include <ferry/options.hpp>
#include <ferry/planner.hpp>
#include <ferry/runtime.hpp>
#include <ferry/save_options.hpp>
#include <ferry/save_plan.hpp>
#include <ferry/size.hpp>
#include <ferry/status.hpp>
#include <ferry/tensor.hpp>

#include <atomic>
#include <cstdio>
#include <memory>
#include <utility>
#include <vector>

namespace {

// A user's filesystem and device, subclassing the library's polymorphic
// classes: they link only if libferry.so exports their vtables and typeinfo
// (DeviceBackend's are emitted in the library alone, next to its first
// out-of-line virtual).
class CountingFs : public ferry::FilesystemWrapper {
 public:
  CountingFs() : FilesystemWrapper(ferry::posix_filesystem()) {}
  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    ++opens;
    return FilesystemWrapper::open(p, o);
  }
  std::atomic<int> opens{0};
};

class CountingDevice : public ferry::DeviceBackend {
 public:
  bool handles(const ferry::Device& d) const override { return host_->handles(d); }
  void copy_out(const ferry::TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override {
    ++copies_out;
    host_->copy_out(src, offset, len, dst, std::move(done));
  }
  void copy_in(const void* src, const ferry::TensorView& dst, uint64_t offset, uint64_t len,
               Done done) override {
    host_->copy_in(src, dst, offset, len, std::move(done));
  }
  std::atomic<int> copies_out{0};

 private:
  std::shared_ptr<ferry::DeviceBackend> host_ = ferry::host_device();
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer ROOT\n");
    return 2;
  }
  // The size syntax the settings read, from the installed library.
  auto pool = ferry::parse_size("8MiB");
  if (!pool.ok() || *pool != (8u << 20) || ferry::parse_size("8 parsecs").ok()) {
    std::fprintf(stderr, "parse_size disagrees with the settings\n");
    return 1;
  }
  ferry::RuntimeArgs args;
  args.set("root", argv[1]).set("pool-bytes", std::to_string(*pool)).set("chunk-bytes", "1MiB");
  auto fs = std::make_shared<CountingFs>();
  auto device = std::make_shared<CountingDevice>();
  args.fs = fs;
  args.device = device;
  auto rt = ferry::Runtime::create(args);
  if (!rt.ok()) {
    std::fprintf(stderr, "create: %s\n", rt.status().to_string().c_str());
    return 1;
  }
  std::vector<float> w(1000), out(1000, 0.f);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.5f;
  ferry::StateDict sd;
  sd.add("w", ferry::TensorView{w.data(), ferry::DType::f32, {1000}});
  ferry::Status st = (*rt)->save_async(sd, 3).wait_committed();
  if (!st.ok()) {
    std::fprintf(stderr, "save: %s\n", st.to_string().c_str());
    return 1;
  }
  ferry::StateDict back;
  back.add("w", ferry::TensorView{out.data(), ferry::DType::f32, {1000}});
  st = (*rt)->load(back, (*rt)->latest());
  if (!st.ok()) {
    std::fprintf(stderr, "load: %s\n", st.to_string().c_str());
    return 1;
  }
  if (out != w) {
    std::fprintf(stderr, "loaded bytes differ\n");
    return 1;
  }
  if (fs->opens == 0 || device->copies_out == 0) {
    std::fprintf(stderr, "the runtime did not go through the user's filesystem and device\n");
    return 1;
  }
  // The public catalog sees what was saved: one committed step of 1,000 floats.
  auto listed = ferry::Catalog().list(argv[1]);
  if (!listed.ok() || listed->size() != 1 || listed->front().tensors != 1 ||
      listed->front().state != ferry::CheckpointState::committed) {
    std::fprintf(
        stderr, "catalog: %s\n",
        listed.ok() ? "not one committed step of one tensor" : listed.status().to_string().c_str());
    return 1;
  }
  auto index = ferry::export_checkpoint(**rt, (*rt)->latest(), std::string(argv[1]) + "/export");
  if (!index.ok()) {
    std::fprintf(stderr, "export: %s\n", index.status().to_string().c_str());
    return 1;
  }
  // The planner in steps: the next step, 4, committed the same way.
  ferry::SavePlanner planner(**rt, sd);
  auto global = planner.create_global_plan();
  if (!global.ok() || planner.step() != 4 ||
      !planner.save_on_this_process((*global)[0]).wait().ok() || !planner.barrier().ok()) {
    std::fprintf(stderr, "planner: %s\n",
                 global.ok() ? "a step failed" : global.status().to_string().c_str());
    return 1;
  }
  std::printf(
      "consumer: saved, loaded and exported step 3, planned and saved step 4 through "
      "Ferry::ferry\n");
  return 0;
}
