#include "work_queue.hpp"

#include <pthread.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ferry {
namespace {

// A latch the tasks wait on, so the test decides when they finish.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int waiting = 0;
  void wait() {
    std::unique_lock<std::mutex> l(mu);
    ++waiting;
    cv.notify_all();
    cv.wait(l, [&] { return open; });
  }
  void until_waiting(int n) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return waiting >= n; });
  }
  void release() {
    std::lock_guard<std::mutex> l(mu);
    open = true;
    cv.notify_all();
  }
};

TEST_CASE("work queue: tasks run in order on one thread, named as asked", "[work_queue]") {
  std::vector<int> order;
  std::set<std::thread::id> threads;
  std::string name;
  {
    WorkQueue q("ferry.test.lane.long", 1, WorkQueue::AtStop::run_queued);
    for (int i = 0; i < 50; ++i)
      q.post([&, i] {
        order.push_back(i);
        threads.insert(std::this_thread::get_id());
        char buf[32] = {};
        pthread_getname_np(pthread_self(), buf, sizeof buf);
        name = buf;
      });
  }
  REQUIRE(order.size() == 50);
  for (int i = 0; i < 50; ++i) CHECK(order[i] == i);
  CHECK(threads.size() == 1);
  CHECK(threads.count(std::this_thread::get_id()) == 0);
  CHECK(name == "ferry.test.lane");  // the kernel keeps 15 characters
}

TEST_CASE("work queue: threads start only when every started one is busy, up to the most",
          "[work_queue]") {
  Gate gate;
  std::mutex mu;
  std::set<std::thread::id> threads;
  auto task = [&] {
    {
      std::lock_guard<std::mutex> l(mu);
      threads.insert(std::this_thread::get_id());
    }
    gate.wait();
  };
  {
    WorkQueue q("ferry.test", 3, WorkQueue::AtStop::run_queued);
    q.post(task);
    gate.until_waiting(1);
    q.post(task);
    q.post(task);
    gate.until_waiting(3);
    q.post(task);  // all three busy and the most started: it waits its turn
    q.post(task);
    gate.release();
  }
  CHECK(threads.size() == 3);
  CHECK(gate.waiting == 5);
}

TEST_CASE("work queue: at stop a lane drops its queued tasks, a reader runs them", "[work_queue]") {
  for (auto at_stop : {WorkQueue::AtStop::drop_queued, WorkQueue::AtStop::run_queued}) {
    Gate gate;
    std::atomic<int> ran{0};
    auto q = std::make_unique<WorkQueue>("ferry.test", 1, at_stop);
    q->post([&] {
      gate.wait();
      ++ran;
    });
    gate.until_waiting(1);
    // The queued tasks hold the token: it expires when they are dropped.
    auto token = std::make_shared<int>(0);
    std::weak_ptr<int> watch = token;
    for (int i = 0; i < 5; ++i) q->post([&ran, token] { ++ran; });
    token.reset();
    std::thread destroyer([&] { q.reset(); });
    if (at_stop == WorkQueue::AtStop::drop_queued)
      while (!watch.expired()) std::this_thread::yield();
    gate.release();
    destroyer.join();
    CHECK(ran == (at_stop == WorkQueue::AtStop::drop_queued ? 1 : 6));
  }
}

TEST_CASE("work queue: submit gives the task's result or its exception", "[work_queue]") {
  WorkQueue q("ferry.test", 2, WorkQueue::AtStop::run_queued);
  auto a = q.submit([] { return std::string("forty-two"); });
  auto b = q.submit([]() -> int { throw std::runtime_error("task failed"); });
  CHECK(a.get() == "forty-two");
  CHECK_THROWS_WITH(b.get(), "task failed");
}

}  // namespace
}  // namespace ferry
