#include "ferry/device.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "checksum.hpp"
#include "copy_bytes.hpp"

using ferry::DType;
using ferry::TensorView;

namespace {

// The view's row-major logical byte stream, element by element: the
// definition the strided helpers must agree with.
std::vector<uint8_t> logical_bytes(const TensorView& v) {
  const size_t es = ferry::dtype_size(v.dtype);
  const auto strides = v.effective_strides();
  std::vector<uint8_t> out;
  const int64_t n = v.numel();
  for (int64_t e = 0; e < n; ++e) {
    int64_t rem = e, off = 0;
    for (size_t k = v.shape.size(); k-- > 0;) {
      off += (rem % v.shape[k]) * strides[k];
      rem /= v.shape[k];
    }
    const auto* p = static_cast<const uint8_t*>(v.data) + off * static_cast<int64_t>(es);
    out.insert(out.end(), p, p + es);
  }
  return out;
}

std::vector<uint8_t> iota_bytes(size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 37 + (i >> 8));
  return b;
}

}  // namespace

TEST_CASE("strided copy of a transposed view matches a reference", "[device]") {
  const int64_t rows = 7, cols = 5;
  for (DType dt : {DType::u8, DType::bf16, DType::f32, DType::f64}) {
    const size_t es = ferry::dtype_size(dt);
    auto storage = iota_bytes(rows * cols * es);
    // storage holds a cols x rows matrix; the view is its rows x cols transpose.
    TensorView t{storage.data(), dt, {rows, cols}, ferry::Device::host(), {1, rows}};
    REQUIRE_FALSE(t.is_contiguous());
    const auto ref = logical_bytes(t);
    REQUIRE(ref.size() == t.nbytes());

    std::mt19937 rng(static_cast<uint32_t>(es));
    for (int iter = 0; iter < 300; ++iter) {
      uint64_t a = std::uniform_int_distribution<uint64_t>(0, ref.size())(rng);
      uint64_t b = std::uniform_int_distribution<uint64_t>(0, ref.size())(rng);
      if (a > b) std::swap(a, b);
      INFO("dtype " << ferry::dtype_name(dt) << " bytes [" << a << ", " << b << ")");

      std::vector<uint8_t> out(b - a + 2, 0xAB);
      ferry::strided_copy_out(t, a, b - a, out.data() + 1);
      CHECK(std::equal(ref.begin() + a, ref.begin() + b, out.begin() + 1));
      CHECK(out.front() == 0xAB);
      CHECK(out.back() == 0xAB);

      // Copy new bytes in over the same range; the rest must stay put.
      std::vector<uint8_t> fresh(b - a);
      for (auto& x : fresh) x = static_cast<uint8_t>(rng());
      auto expect = ref;
      std::copy(fresh.begin(), fresh.end(), expect.begin() + a);
      auto saved = storage;
      ferry::strided_copy_in(fresh.data(), t, a, b - a);
      CHECK(logical_bytes(t) == expect);
      storage = saved;
    }
  }
}

TEST_CASE("strided copy: contiguous, sliced and degenerate views", "[device]") {
  SECTION("contiguous view at any range") {
    auto storage = iota_bytes(6 * 4 * 4);
    TensorView t{storage.data(), DType::f32, {6, 4}};
    std::vector<uint8_t> out(13);
    ferry::strided_copy_out(t, 7, 13, out.data());
    CHECK(std::equal(out.begin(), out.end(), storage.begin() + 7));
  }
  SECTION("row slice of a wider matrix: dense rows, strided outer dim") {
    auto storage = iota_bytes(4 * 10 * 2);
    // Columns 3..8 of a 4 x 10 bf16 matrix.
    TensorView t{storage.data() + 3 * 2, DType::bf16, {4, 6}, ferry::Device::host(), {10, 1}};
    const auto ref = logical_bytes(t);
    for (uint64_t a = 0; a < ref.size(); a += 3) {
      for (uint64_t b = a; b <= ref.size(); b += 5) {
        std::vector<uint8_t> out(b - a);
        ferry::strided_copy_out(t, a, b - a, out.data());
        CHECK(std::equal(out.begin(), out.end(), ref.begin() + a));
      }
    }
  }
  SECTION("3-D permuted view with size-1 dims") {
    auto storage = iota_bytes(3 * 1 * 4 * 8);
    // A [3,1,4] f64 tensor viewed as [4,1,3].
    TensorView t{storage.data(), DType::f64, {4, 1, 3}, ferry::Device::host(), {1, 4, 4}};
    const auto ref = logical_bytes(t);
    std::vector<uint8_t> out(ref.size() - 11);
    ferry::strided_copy_out(t, 5, out.size(), out.data());
    CHECK(std::equal(out.begin(), out.end(), ref.begin() + 5));

    std::vector<uint8_t> back = ref;
    std::reverse(back.begin(), back.end());
    ferry::strided_copy_in(back.data(), t, 0, back.size());
    CHECK(logical_bytes(t) == back);
  }
  SECTION("0-d scalar") {
    double x = 2.5, y = 0;
    TensorView t{&x, DType::f64, {}};
    ferry::strided_copy_out(t, 0, 8, &y);
    CHECK(y == 2.5);
  }
}

TEST_CASE("copies out of a megabyte or more are exact at every alignment, nothing past them",
          "[device]") {
  // From a megabyte on, the copy out uses streaming stores with an aligned
  // middle and copied ends: every split of head, body and tail is tried.
  constexpr uint64_t kMiB = 1 << 20;
  std::mt19937 rng(11);
  std::vector<uint8_t> storage(kMiB + 4096);
  for (auto& b : storage) b = static_cast<uint8_t>(rng());
  TensorView t{storage.data(), DType::u8, {static_cast<int64_t>(storage.size())}};
  std::vector<uint8_t> out(kMiB + 4096 + 64);
  for (uint64_t len : {kMiB - 1, kMiB, kMiB + 1, kMiB + 127, kMiB + 128, kMiB + 131}) {
    for (uint64_t from : {0, 1, 31, 32, 63}) {
      for (uint64_t to : {0, 1, 17, 31, 32}) {
        INFO("len " << len << " from " << from << " to " << to);
        std::fill(out.begin(), out.end(), 0xEE);
        ferry::strided_copy_out(t, from, len, out.data() + to);
        CHECK(std::equal(out.begin() + to, out.begin() + to + len, storage.begin() + from));
        CHECK(std::all_of(out.begin(), out.begin() + to, [](uint8_t b) { return b == 0xEE; }));
        CHECK(std::all_of(out.begin() + to + len, out.end(), [](uint8_t b) { return b == 0xEE; }));
      }
    }
  }
  SECTION("rows of a megabyte and more from a wider matrix") {
    // 3 rows of 1 MiB + 40 bytes out of rows 1 MiB + 100 wide: dense rows.
    const int64_t cols = kMiB + 100, width = kMiB + 40;
    std::vector<uint8_t> wide(3 * cols);
    for (auto& b : wide) b = static_cast<uint8_t>(rng());
    TensorView rows{wide.data() + 7, DType::u8, {3, width}, ferry::Device::host(), {cols, 1}};
    std::vector<uint8_t> got(3 * width + 5);
    ferry::strided_copy_out(rows, 0, 3 * width, got.data() + 5);
    for (int64_t r = 0; r < 3; ++r) {
      INFO("row " << r);
      CHECK(std::equal(got.begin() + 5 + r * width, got.begin() + 5 + (r + 1) * width,
                       wide.begin() + 7 + r * cols));
    }
  }
}

TEST_CASE("copies into a tensor of a megabyte or more are exact at every alignment", "[device]") {
  // A load's copies of checked blocks into tensors stream from a megabyte on
  // too: the contiguous path (host device copy_in_runs) and the strided
  // helper, every split of head, body and tail, nothing written past them.
  constexpr uint64_t kMiB = 1 << 20;
  std::mt19937 rng(12);
  std::vector<uint8_t> src(kMiB + 4096);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> storage(kMiB + 4096 + 64);
  auto dev = ferry::host_device();
  for (bool runs : {false, true}) {
    for (uint64_t len : {kMiB - 1, kMiB, kMiB + 1, kMiB + 127, kMiB + 131}) {
      for (uint64_t from : {0, 1, 32, 63}) {
        for (uint64_t to : {0, 1, 17, 32}) {
          INFO((runs ? "copy_in_runs" : "strided_copy_in")
               << " len " << len << " from " << from << " to " << to);
          std::fill(storage.begin(), storage.end(), 0xEE);
          TensorView t{storage.data(), DType::u8, {static_cast<int64_t>(storage.size())}};
          if (runs) {
            ferry::Status st = ferry::Status::internal("not reported");
            dev->copy_in_runs(src.data(), t, {{from, to, len}}, [&](ferry::Status s) { st = s; });
            REQUIRE(st.ok());
          } else {
            ferry::strided_copy_in(src.data() + from, t, to, len);
          }
          CHECK(std::equal(storage.begin() + to, storage.begin() + to + len, src.begin() + from));
          CHECK(std::all_of(storage.begin(), storage.begin() + to,
                            [](uint8_t b) { return b == 0xEE; }));
          CHECK(std::all_of(storage.begin() + to + len, storage.end(),
                            [](uint8_t b) { return b == 0xEE; }));
        }
      }
    }
  }
}

TEST_CASE("host device copies synchronously and reports", "[device]") {
  auto dev = ferry::host_device();
  CHECK(dev->handles(ferry::Device::host()));
  CHECK_FALSE(dev->handles(ferry::Device::cuda(0)));

  std::vector<int32_t> storage(12);
  std::iota(storage.begin(), storage.end(), 0);
  TensorView t{storage.data(), DType::i32, {4, 3}, ferry::Device::host(), {1, 4}};

  std::vector<int32_t> out(12, -1);
  bool called = false;
  dev->copy_out(t, 0, 48, out.data(), [&](ferry::Status st) {
    CHECK(st.ok());
    called = true;
  });
  CHECK(called);
  CHECK(out == std::vector<int32_t>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});

  std::vector<int32_t> in{100, 101, 102};
  called = false;
  dev->copy_in(in.data(), t, 12, 12, [&](ferry::Status st) {
    CHECK(st.ok());
    called = true;
  });
  CHECK(called);
  CHECK(storage[1] == 100);
  CHECK(storage[5] == 101);
  CHECK(storage[9] == 102);

  ferry::Status err;
  dev->copy_out(t, 40, 16, out.data(), [&](ferry::Status st) { err = st; });
  CHECK(err.code() == ferry::StatusCode::invalid_argument);
  TensorView gpu{storage.data(), DType::i32, {12}, ferry::Device::cuda(0)};
  dev->copy_out(gpu, 0, 4, out.data(), [&](ferry::Status st) { err = st; });
  CHECK(err.code() == ferry::StatusCode::invalid_argument);
}

// The load's one-pass copy of a checked block: the host device sums and
// copies a stretch of a contiguous tensor; a strided view, a range past the
// tensor, a device tensor or a backend that does not offer it leaves the
// tensor untouched and answers nullopt (the loader then copies apart).
TEST_CASE("copy_in_summed copies and sums a contiguous stretch, else declines", "[device]") {
  auto dev = ferry::host_device();
  std::vector<uint8_t> src(3u << 20);
  std::mt19937_64 rng(5);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<float> storage(src.size() / 4 + 64, -1.0f);
  TensorView t{storage.data(), DType::f32, {static_cast<int64_t>(storage.size())}};
  const uint64_t offset = 4096 + 64, len = (2u << 20) + 300;
  auto sum = dev->copy_in_summed(src.data(), t, offset, len);
  REQUIRE(sum.has_value());
  CHECK(*sum == ferry::xxh3_64(src.data(), len));
  const auto* bytes = reinterpret_cast<const uint8_t*>(storage.data());
  CHECK(std::memcmp(bytes + offset, src.data(), len) == 0);
  CHECK(storage[offset / 4 - 1] == -1.0f);
  CHECK(storage[(offset + len + 3) / 4] == -1.0f);

  std::vector<float> before = storage;
  CHECK_FALSE(dev->copy_in_summed(src.data(), t, t.nbytes() - 8, 16).has_value());
  TensorView strided{storage.data(), DType::f32, {64, 64}, ferry::Device::host(), {1, 64}};
  CHECK_FALSE(dev->copy_in_summed(src.data(), strided, 0, 4096).has_value());
  TensorView gpu{storage.data(), DType::f32, {64}, ferry::Device::cuda(0)};
  CHECK_FALSE(dev->copy_in_summed(src.data(), gpu, 0, 256).has_value());
  struct Plain : ferry::DeviceBackend {
    bool handles(const ferry::Device&) const override { return true; }
    void copy_out(const TensorView&, uint64_t, uint64_t, void*, Done d) override { d({}); }
    void copy_in(const void*, const TensorView&, uint64_t, uint64_t, Done d) override { d({}); }
  } plain;
  CHECK_FALSE(plain.copy_in_summed(src.data(), t, 0, 4096).has_value());
  // Bytes, not floats: random bytes make NaNs, which equal nothing.
  CHECK(std::memcmp(storage.data(), before.data(), storage.size() * 4) == 0);
}

TEST_CASE("copy_bytes is exact at every distance modulo a page, nothing past it", "[device]") {
  // Destinations up to 64 bytes past the source modulo 4 KiB take the AVX2
  // loop (an aligned middle, copied ends); the others memcpy.
  std::mt19937 rng(5);
  std::vector<uint8_t> src(80 << 10);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> out(src.size() + 2 * 4096);
  // Page-aligned bases, so `from` and `to` set the distance modulo a page.
  auto* in =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(src.data()) + 4095) & ~4095ull);
  auto* dst =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(out.data()) + 4095) & ~4095ull);
  const size_t room = static_cast<size_t>(out.data() + out.size() - dst);
  for (size_t len : {size_t{0}, size_t{1}, size_t{2047}, size_t{2048}, size_t{4096 + 17},
                     size_t{64 << 10} + 5}) {
    for (size_t from : {0, 16, 100}) {
      for (size_t to : {0, 1, 16, 31, 63, 64, 65, 200, 4095}) {
        const size_t at = from + to;
        INFO("len " << len << " from " << from << " dst - src " << to);
        std::fill(out.begin(), out.end(), 0xEE);
        ferry::copy_bytes(dst + at, in + from, len);
        CHECK(std::equal(dst + at, dst + at + len, in + from));
        CHECK(std::all_of(out.data(), dst + at, [](uint8_t b) { return b == 0xEE; }));
        CHECK(std::all_of(dst + at + len, dst + room, [](uint8_t b) { return b == 0xEE; }));
      }
    }
  }
}

TEST_CASE("copy_in_runs lands every run, reports once, and fails on a run past the tensor",
          "[device]") {
  auto dev = ferry::host_device();
  const std::vector<uint8_t> host = iota_bytes(4096);
  const std::vector<ferry::DeviceBackend::Run> runs{{0, 8, 8}, {100, 40, 3000}, {3200, 3100, 12}};
  SECTION("contiguous and strided tensors alike, as copy_in would") {
    std::vector<uint8_t> store(4 * 1024, 0), want(4 * 1024, 0);
    // The same bytes viewed transposed: the runs land strided.
    for (bool transposed : {false, true}) {
      INFO("transposed " << transposed);
      std::fill(store.begin(), store.end(), 0);
      std::fill(want.begin(), want.end(), 0);
      auto view = [&](std::vector<uint8_t>& b) {
        return transposed
                   ? TensorView{b.data(), DType::u8, {64, 64}, ferry::Device::host(), {1, 64}}
                   : TensorView{b.data(), DType::u8, {4096}};
      };
      int reports = 0;
      ferry::Status got;
      dev->copy_in_runs(host.data(), view(store), runs, [&](ferry::Status st) {
        ++reports;
        got = st;
      });
      for (const auto& r : runs)
        dev->copy_in(host.data() + r.src, view(want), r.dst, r.len, [](ferry::Status) {});
      CHECK(reports == 1);
      CHECK(got.ok());
      CHECK(store == want);
      if (!transposed) CHECK(store[8] == host[0]);
      CHECK(std::count(store.begin(), store.end(), 0) < 4096 - 3000);
    }
  }
  SECTION("a run past the tensor fails the batch, naming its range") {
    std::vector<uint8_t> store(4096, 0);
    TensorView t{store.data(), DType::u8, {4096}};
    auto bad = runs;
    bad.push_back({0, 4090, 16});
    ferry::Status got;
    int reports = 0;
    dev->copy_in_runs(host.data(), t, bad, [&](ferry::Status st) {
      ++reports;
      got = st;
    });
    CHECK(reports == 1);
    CHECK(got.code() == ferry::StatusCode::invalid_argument);
    CHECK_THAT(got.message(), Catch::Contains("[4090, 4106)"));
  }
}

// A backend that copies on a thread of its own and fails the copies into
// one byte range: what the default copy_in_runs must join.
class ThreadedDevice final : public ferry::DeviceBackend {
 public:
  ~ThreadedDevice() override {
    for (auto& t : threads_) t.join();
  }
  bool handles(const ferry::Device& d) const override { return d.is_host(); }
  void copy_out(const TensorView&, uint64_t, uint64_t, void*, Done done) override {
    done(ferry::Status::unsupported("copy_out"));
  }
  void copy_in(const void* src, const TensorView& dst, uint64_t offset, uint64_t len,
               Done done) override {
    std::lock_guard<std::mutex> l(mu_);
    threads_.emplace_back([=] {
      std::this_thread::yield();
      if (offset == 40) return done(ferry::Status::io_error("copy at 40 failed"));
      std::memcpy(static_cast<uint8_t*>(dst.data) + offset, src, len);
      done(ferry::Status());
    });
  }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

TEST_CASE("the default copy_in_runs reports once, after the last copy, with the first error",
          "[device]") {
  const std::vector<uint8_t> host = iota_bytes(4096);
  std::vector<uint8_t> store(4096, 0);
  TensorView t{store.data(), DType::u8, {4096}};
  std::mutex mu;
  std::vector<ferry::Status> reports;
  {
    ThreadedDevice dev;
    dev.copy_in_runs(
        host.data(), t, {{0, 8, 8}, {100, 40, 300}, {3200, 3100, 12}}, [&](ferry::Status st) {
          std::lock_guard<std::mutex> l(mu);
          // Every other copy has landed by now.
          CHECK(std::equal(store.begin() + 8, store.begin() + 16, host.begin()));
          CHECK(std::equal(store.begin() + 3100, store.begin() + 3112, host.begin() + 3200));
          reports.push_back(st);
        });
  }  // joins the copies
  REQUIRE(reports.size() == 1);
  CHECK(reports[0].code() == ferry::StatusCode::io_error);
  ThreadedDevice dev;
  int calls = 0;
  dev.copy_in_runs(host.data(), t, {}, [&](ferry::Status st) {
    ++calls;
    CHECK(st.ok());
  });
  CHECK(calls == 1);
}
