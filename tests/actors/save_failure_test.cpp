// A failed save must end cleanly: once its handle reports the failure,
// nothing of Ferry touches the caller's memory or a file descriptor again,
// and the descriptors it closed cannot have been in use by another thread.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "drills/fault_fs.hpp"
#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "test_util.hpp"

using ferry::testing::TempDir;

namespace {

// What the instrumented files saw, across all of them.
struct FileStats {
  std::atomic<uint64_t> writes{0};
  std::atomic<uint64_t> closed_while_busy{0};  // close() while another thread was inside a call
  uint64_t fail_at = 0;                        // the nth pwrite fails with ENOSPC (0: none)
};

// A data file with its own descriptor that widens the window every thread
// has anyway: between loading the descriptor and entering the syscall a
// thread can be preempted, and a descriptor closed meanwhile may already be
// someone else's file when the syscall runs.
class PreemptedFile : public ferry::File {
 public:
  PreemptedFile(int fd, std::string path, FileStats* stats)
      : fd_(fd), path_(std::move(path)), stats_(stats) {}
  ~PreemptedFile() override { (void)close(); }
  const std::string& path() const override { return path_; }
  bool direct() const override { return false; }

  ferry::Status pwrite(const void* data, size_t len, uint64_t offset) override {
    if (stats_->fail_at != 0 && ++stats_->writes == stats_->fail_at)
      return ferry::Status::from_errno(ENOSPC, "pwrite", path_ + " (injected)");
    return call([&](int fd) { return ::pwrite(fd, data, len, static_cast<off_t>(offset)) < 0; },
                "pwrite");
  }
  ferry::Result<size_t> pread(void*, size_t, uint64_t) override {
    return ferry::Status::unsupported("pread on a write-only test file");
  }
  ferry::Status truncate(uint64_t size) override {
    return call([&](int fd) { return ::ftruncate(fd, static_cast<off_t>(size)) != 0; }, "truncate");
  }
  ferry::Status sync() override {
    return call([](int fd) { return ::fsync(fd) != 0; }, "fsync");
  }
  ferry::Status close() override {
    if (busy_.load() > 0) ++stats_->closed_while_busy;
    const int fd = fd_.exchange(-1);
    if (fd >= 0) ::close(fd);
    return ferry::Status();
  }

 private:
  template <class F>
  ferry::Status call(F&& f, const char* op) {
    ++busy_;
    const int fd = fd_.load();
    std::this_thread::sleep_for(std::chrono::microseconds(500));  // the preemption
    const bool failed = fd < 0 || f(fd);
    const int err = fd < 0 ? EBADF : errno;
    --busy_;
    return failed ? ferry::Status::from_errno(err, op, path_) : ferry::Status();
  }

  std::atomic<int> fd_;
  std::atomic<int> busy_{0};
  std::string path_;
  FileStats* stats_;
};

class PreemptedFs : public ferry::FilesystemWrapper {
 public:
  explicit PreemptedFs(FileStats* stats)
      : FilesystemWrapper(ferry::posix_filesystem()), stats_(stats) {}
  ferry::Result<std::unique_ptr<ferry::File>> open(const std::string& p,
                                                   const ferry::OpenOptions& o) override {
    if (p.find(".safetensors") == std::string::npos) return target_->open(p, o);
    int flags = O_CLOEXEC | O_RDWR | O_CREAT | (o.exclusive ? O_EXCL : 0);
    const int fd = ::open(p.c_str(), flags, 0644);
    if (fd < 0) return ferry::Status::from_errno(errno, "open", p);
    return std::unique_ptr<ferry::File>(new PreemptedFile(fd, p, stats_));
  }

 private:
  FileStats* stats_;
};

// Completes copies later on a thread of its own, as a GPU stream does, and
// notes every copy that starts or runs after the test said the save is over.
struct CopyStats {
  std::atomic<bool> over{false};        // set by the test when the handle reported the end
  std::atomic<int> in_flight{0};        // copies started and not completed
  std::atomic<uint64_t> after_over{0};  // copies that started or ran after `over`
};

class LateCopyDevice : public ferry::DeviceBackend {
 public:
  explicit LateCopyDevice(CopyStats* stats) : stats_(stats), worker_([this] { run(); }) {}
  ~LateCopyDevice() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  bool handles(const ferry::Device& d) const override { return d.is_host(); }
  void copy_out(const ferry::TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override {
    ++stats_->in_flight;
    if (stats_->over.load()) ++stats_->after_over;
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back([this, src, offset, len, dst, done = std::move(done)] {
      if (stats_->over.load()) ++stats_->after_over;
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // the copy engine's time
      ferry::strided_copy_out(src, offset, len, dst);
      --stats_->in_flight;
      done(ferry::Status());
    });
    cv_.notify_all();
  }
  void copy_in(const void* src, const ferry::TensorView& dst, uint64_t offset, uint64_t len,
               Done done) override {
    ferry::strided_copy_in(src, dst, offset, len);
    done(ferry::Status());
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  CopyStats* stats_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;
};

uint64_t file_size(int fd) {
  struct stat sb;
  REQUIRE(::fstat(fd, &sb) == 0);
  return static_cast<uint64_t>(sb.st_size);
}

}  // namespace

TEST_CASE("a failed save closes no descriptor a writer thread may still use",
          "[actors][save][failure]") {
  TempDir dir, mine;
  std::vector<float> a(1 << 20);  // 4 MiB: 64 blocks over 4 writers
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  ferry::StateDict sd;
  REQUIRE(sd.add("w", {a.data(), ferry::DType::f32, {1024, 1024}}).ok());
  uint64_t foreign_bytes = 0, closed_while_busy = 0, failed = 0;
  for (int round = 0; round < 20; ++round) {
    FileStats stats;
    stats.fail_at = 6;
    std::vector<int> fds;
    {
      ferry::RuntimeArgs args;
      args.set("root", dir.path()).set("pool-bytes", "4MiB").set("chunk-bytes", "64KiB");
      args.set("writers", "4").set("direct-io", "false");
      args.fs = std::make_shared<PreemptedFs>(&stats);
      auto rt = ferry::Runtime::create(args);
      REQUIRE(rt.ok());
      ferry::Status st = (*rt)->save_async(sd, round).wait_committed();
      failed += !st.ok();
      // The caller goes on with its own files at once: they get the lowest
      // free descriptor numbers, those Ferry's files just had if it closed them.
      for (int i = 0; i < 8; ++i) {
        const std::string p = mine.sub("mine-" + std::to_string(round) + "-" + std::to_string(i));
        const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        REQUIRE(fd >= 0);
        fds.push_back(fd);
      }
    }  // the runtime and its writer threads are gone: any late write has landed
    for (int fd : fds) {
      foreign_bytes += file_size(fd);
      ::close(fd);
    }
    closed_while_busy += stats.closed_while_busy.load();
  }
  CHECK(failed == 20);
  CHECK(closed_while_busy == 0);
  CHECK(foreign_bytes == 0);
}

TEST_CASE("a failed save reports only after no copy from the caller's memory can run",
          "[actors][save][failure]") {
  TempDir dir;
  const size_t bytes = 8u << 20;  // the pool holds an eighth: the snapshot is still copying
  uint64_t late = 0, in_flight_at_report = 0, failed = 0;
  for (int round = 0; round < 10; ++round) {
    CopyStats copies;
    auto device = std::make_shared<LateCopyDevice>(&copies);
    auto faults = std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
    ferry::FaultRule rule;
    rule.op = ferry::FaultOp::write;
    rule.nth = 3;
    faults->add_rule(rule);
    ferry::RuntimeArgs args;
    args.set("root", dir.path()).set("pool-bytes", "1MiB").set("chunk-bytes", "64KiB");
    args.set("direct-io", "false");
    args.fs = faults;
    args.device = device;
    auto created = ferry::Runtime::create(args);
    REQUIRE(created.ok());
    std::unique_ptr<ferry::Runtime> rt = std::move(created).value();
    void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(mem != MAP_FAILED);
    std::memset(mem, 0x5a, bytes);
    ferry::StateDict sd;
    REQUIRE(sd.add("w", {mem, ferry::DType::u8, {static_cast<int64_t>(bytes)}}).ok());
    auto h = rt->save_async(sd, round);
    const ferry::Status st = h.wait_committed();
    copies.over = true;
    in_flight_at_report += static_cast<uint64_t>(copies.in_flight.load());
    // The caller frees its tensors as soon as it hears the save is over.
    REQUIRE(::munmap(mem, bytes) == 0);
    failed += !st.ok();
    CHECK(h.snapshot_done());
    rt.reset();      // every actor is gone,
    device.reset();  // and every copy it was ever asked for has run
    late += copies.after_over.load();
  }
  CHECK(failed == 10);
  CHECK(in_flight_at_report == 0);
  CHECK(late == 0);
}
