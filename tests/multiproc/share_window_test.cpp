// Flow control of shared load bytes (actors/share_window.hpp): a sender waits
// while its window toward a receiver is full, and every wait ends, with an
// error naming the receiver when no ack will come. Real threads; the waits
// end on real events (an ack, a failure, the load's end, the deadline).

#include <catch2/catch.hpp>

#include <chrono>
#include <future>
#include <thread>

#include "actors/share_window.hpp"

using ferry::ShareWindows;
using ferry::Status;
using ferry::StatusCode;

namespace {

constexpr uint64_t kWindow = 1000;
constexpr double kLong = 60;  // a deadline no test should reach

// Starts an acquire on its own thread, as a reader does.
std::future<Status> acquire_async(ShareWindows& w, int32_t to, uint64_t bytes,
                                  double timeout_s = kLong) {
  return std::async(std::launch::async, [&w, to, bytes, timeout_s] {
    return w.acquire("load-1", to, bytes, kWindow, timeout_s);
  });
}

bool still_waiting(std::future<Status>& f) {
  return f.wait_for(std::chrono::milliseconds(50)) == std::future_status::timeout;
}

}  // namespace

TEST_CASE("a sender waits while its window is full and goes on when acks make room",
          "[share_window]") {
  ShareWindows w;
  w.open(0, "load-1", {1, 2});
  REQUIRE(w.acquire("load-1", 1, 600, kWindow, kLong).ok());
  REQUIRE(w.acquire("load-1", 1, 400, kWindow, kLong).ok());
  CHECK(w.outstanding("load-1", 1) == 1000);
  // The window toward rank 2 is its own.
  REQUIRE(w.acquire("load-1", 2, 1000, kWindow, kLong).ok());

  auto waiting = acquire_async(w, 1, 300);
  CHECK(still_waiting(waiting));
  REQUIRE(w.ack("load-1", 1, 200, Status()).ok());  // 800 outstanding: 300 do not fit yet
  CHECK(still_waiting(waiting));
  REQUIRE(w.ack("load-1", 1, 400, Status()).ok());  // 400 outstanding: they fit
  CHECK(waiting.get().ok());
  CHECK(w.outstanding("load-1", 1) == 700);

  // A frame larger than the window goes alone, once nothing is outstanding.
  REQUIRE(w.ack("load-1", 1, 700, Status()).ok());
  CHECK(w.acquire("load-1", 1, 5000, kWindow, kLong).ok());
}

TEST_CASE("bad acks are refused with a reason and change nothing", "[share_window]") {
  ShareWindows w;
  w.open(0, "load-1", {1});
  REQUIRE(w.acquire("load-1", 1, 100, kWindow, kLong).ok());

  Status s = w.ack("load-1", 1, 101, Status());
  CHECK(s.code() == StatusCode::invalid_argument);
  CHECK_THAT(s.message(), Catch::Contains("acknowledges 101 bytes, but 100 are outstanding"));
  s = w.ack("load-9", 1, 1, Status());
  CHECK_THAT(s.message(), Catch::Contains("load-9"));
  s = w.ack("load-1", 3, 1, Status());
  CHECK_THAT(s.message(), Catch::Contains("rank 3"));
  CHECK(w.outstanding("load-1", 1) == 100);

  // Acks still in flight when a load ends are expected, not forged.
  w.close("load-1", Status());
  CHECK(w.ack("load-1", 1, 100, Status()).ok());
}

TEST_CASE("a refusal that comes before the sender opens the load closes its window at once",
          "[share_window]") {
  // The receiver's load failed and it refused more bytes before this rank
  // (slow to start) opened the load: the sender must not wait for acks.
  ShareWindows w;
  REQUIRE(w.ack("load-1", 1, 0, Status::aborted("rank 1: rank 3 failed")).ok());
  // An early ack that is no refusal is still stray.
  CHECK(w.ack("load-1", 2, 5, Status()).code() == StatusCode::invalid_argument);
  w.open(0, "load-1", {1, 2});
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = w.acquire("load-1", 1, 10, kWindow, kLong);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK(s.code() == StatusCode::aborted);
  CHECK_THAT(s.message(), Catch::Contains("to rank 1") &&
                              Catch::Contains("rank 1 takes no more bytes") &&
                              Catch::Contains("rank 3 failed"));
  // Only that receiver's window, only that load.
  CHECK(w.acquire("load-1", 2, 10, kWindow, kLong).ok());
  w.open(0, "load-2", {1});
  CHECK(w.acquire("load-2", 1, 10, kWindow, kLong).ok());
}

TEST_CASE("every wait ends: refusal, failure, the load's end, the deadline", "[share_window]") {
  ShareWindows w;
  w.open(0, "load-1", {1, 2, 3});
  for (int32_t r : {1, 2, 3}) REQUIRE(w.acquire("load-1", r, kWindow, kWindow, kLong).ok());

  SECTION("the receiver refuses more bytes") {
    auto waiting = acquire_async(w, 1, 10);
    CHECK(still_waiting(waiting));
    REQUIRE(w.ack("load-1", 1, 0, Status::corruption("rank 1: checksum mismatch")).ok());
    const Status s = waiting.get();
    CHECK(s.code() == StatusCode::corruption);
    CHECK_THAT(s.message(), Catch::Contains("to rank 1") &&
                                Catch::Contains("rank 1 takes no more bytes") &&
                                Catch::Contains("checksum mismatch"));
    // The others' windows stay open.
    REQUIRE(w.ack("load-1", 2, 10, Status()).ok());
    CHECK(w.acquire("load-1", 2, 10, kWindow, kLong).ok());
  }
  SECTION("the receiver fails") {
    auto waiting = acquire_async(w, 2, 10);
    CHECK(still_waiting(waiting));
    w.fail_rank(2, Status::aborted("rank 2 failed: endpoint closed"));
    const Status s = waiting.get();
    CHECK(s.code() == StatusCode::aborted);
    CHECK_THAT(s.message(), Catch::Contains("rank 2 failed"));
    // A failed rank stays failed: a later load cannot send to it either.
    w.open(0, "load-2", {2});
    CHECK_THAT(w.acquire("load-2", 2, 1, kWindow, kLong).message(),
               Catch::Contains("rank 2 failed"));
  }
  SECTION("rank 0, which carries every ack, fails") {
    auto a = acquire_async(w, 1, 10);
    auto b = acquire_async(w, 3, 10);
    CHECK(still_waiting(a));
    w.fail_rank(0, Status::aborted("rank 0 failed: gone"), /*every=*/true);
    CHECK_THAT(a.get().message(), Catch::Contains("rank 0 failed"));
    CHECK_THAT(b.get().message(), Catch::Contains("rank 0 failed"));
  }
  SECTION("the load ends here") {
    auto waiting = acquire_async(w, 3, 10);
    CHECK(still_waiting(waiting));
    w.close("load-1", Status::io_error("rank 0: pread failed"));
    const Status s = waiting.get();
    CHECK(s.code() == StatusCode::io_error);
    CHECK_THAT(s.message(), Catch::Contains("to rank 3") && Catch::Contains("pread failed"));
  }
  SECTION("the loader stops") {
    auto waiting = acquire_async(w, 3, 10);
    CHECK(still_waiting(waiting));
    w.close_all(Status::internal("the loader stopped"));
    CHECK_THAT(waiting.get().message(), Catch::Contains("loader stopped"));
  }
  SECTION("no ack comes") {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = w.acquire("load-1", 1, 10, kWindow, 0.3);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(s.code() == StatusCode::timeout);
    CHECK_THAT(s.message(),
               Catch::Contains("rank 1 took none") && Catch::Contains("1000 bytes unacknowledged"));
    CHECK(took >= 0.3);
    CHECK(took < 10);
  }
}
