// WorkQueue: threads taking tasks from one FIFO queue. The snapshot's host
// copy lanes, the loader's pread threads and the compressor's workers are
// all one of these.
#pragma once

#include <pthread.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace ferry {

class WorkQueue {
 public:
  // What the destructor does with tasks not started yet: a snapshot lane
  // drops them (its save is over), a reader runs them (their futures are
  // waited for).
  enum class AtStop { drop_queued, run_queued };

  // Threads start when a task finds every started one busy, up to
  // max_threads: a thread start costs kernel time that a queue which never
  // needs a second one should not pay. `name` is each thread's name (15
  // characters shown), as top and the tests see it.
  WorkQueue(std::string name, size_t max_threads, AtStop at_stop)
      : name_(std::move(name)), max_(max_threads < 1 ? 1 : max_threads), at_stop_(at_stop) {}
  ~WorkQueue() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
      if (at_stop_ == AtStop::drop_queued) queue_.clear();
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Throws std::system_error only when no thread could be started at all
  // (with one started, the started ones take the task in turn).
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> l(mu_);
      queue_.push_back(std::move(task));
      if (queue_.size() > idle_ && threads_.size() < max_) {
        try {
          threads_.emplace_back([this] { loop(); });
        } catch (const std::system_error&) {
          if (threads_.empty()) {
            queue_.pop_back();
            throw;
          }
        }
      }
    }
    cv_.notify_one();
  }

  // post() of fn, whose result (or exception) comes through the future.
  template <class Fn>
  auto submit(Fn fn) -> std::future<decltype(fn())> {
    auto task = std::make_shared<std::packaged_task<decltype(fn())()>>(std::move(fn));
    auto got = task->get_future();
    post([task] { (*task)(); });
    return got;
  }

 private:
  void loop() {
    pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(l, [this] { return stop_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stopping, and nothing left to run
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      l.unlock();
      task();
      task = nullptr;  // its captures go before the lock is taken again
      l.lock();
    }
  }

  const std::string name_;
  const size_t max_;
  const AtStop at_stop_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  size_t idle_ = 0;  // started threads waiting for a task
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace ferry
