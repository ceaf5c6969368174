// Flow control for the bytes of a load that one rank reads for the others of
// its node (BlockShare frames). Per load and receiver a sender keeps at most a
// window of bytes sent and not yet acknowledged by the receiver (ShareAck);
// a reader thread that would pass it waits here. Every queue on the way (the
// sender's transport, rank 0's relay where two ranks have no direct lane, the
// receiver's mailboxes) then holds at most the sum of the windows, whatever
// the size of the state.
//
// A wait always ends: an ack that makes room, the receiver's failure or its
// refusal of more bytes (an ack with an error), the load's end on this rank,
// or no ack for the timeout. Errors name the receiver.
//
//   open(load) --acquire/ack...--> close(load): windows dropped, waiters fail;
//   acks that come late for a closed load are ignored. A refusal that comes
//   early (a receiver whose load failed before this rank opened the same
//   load) is kept, and the window toward it opens closed: a sender that
//   starts late would otherwise wait for acks that never come.
//
// Thread-safety: every method may be called from any thread. acquire()
// blocks, so it belongs on a reader's own thread, never on a scheduler's.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/status.hpp"

namespace ferry {

class ShareWindows {
 public:
  // Starts the windows of `load` toward `receivers` (a receiver that failed
  // already starts closed). `me` names this rank in errors.
  void open(int32_t me, const std::string& load, const std::vector<int32_t>& receivers);

  // Takes `bytes` of the window toward `to`, waiting while they do not fit
  // in `window` (a frame larger than the window goes when nothing is
  // outstanding). Fails, naming `to`, when the window closed, the load is
  // not open, or no ack came from `to` for `timeout_s` while waiting.
  Status acquire(const std::string& load, int32_t to, uint64_t bytes, uint64_t window,
                 double timeout_s);

  // An ack from receiver `from`: it took `bytes` more, or (status not ok)
  // takes no more bytes of `load`, which closes the window toward it. An ack
  // for a load that ended here lately is ignored (ok), a refusal for a load
  // not open yet is kept for open() (ok). Errors, for the caller to log and
  // drop: a load or receiver this rank sends nothing to, more bytes than are
  // outstanding.
  Status ack(const std::string& load, int32_t from, uint64_t bytes, const Status& status);

  // Rank `rank` failed: every window toward it closes, now and in later
  // loads. `every`: close all windows (on a rank > 0 when rank 0 failed,
  // since every ack comes through rank 0).
  void fail_rank(int32_t rank, const Status& why, bool every = false);

  // Rank `rank` rejoined the job (after a partition): windows of later loads
  // toward it open again; rank 0's return undoes fail_rank's `every` too.
  void rejoined(int32_t rank);

  // The load ended on this rank: its windows go, and a sender still waiting
  // fails with `why` (or, when ok, with "the load ended").
  void close(const std::string& load, const Status& why);
  // Closes every open load (the loader stops).
  void close_all(const Status& why);

  // Why `rank` failed (fail_rank), if it did: a load that starts later and
  // expects bytes from it fails at once.
  std::optional<Status> failure(int32_t rank);

  // Bytes outstanding toward `to` in `load` (0 when not open); for tests.
  uint64_t outstanding(const std::string& load, int32_t to);

  // Rank 0 passed a frame of shared bytes (or an ack) on between two other
  // ranks, which had no direct lane. take_relayed(): how many since the
  // previous call (a load's report).
  void count_relayed() { relayed_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t take_relayed() { return relayed_.exchange(0); }
  // Bytes this rank put in its receivers' share rings since the previous call.
  void count_in_memory(uint64_t n) { in_memory_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t take_in_memory() { return in_memory_.exchange(0); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Window {
    uint64_t outstanding = 0;
    Status closed;  // not ok: no more bytes go
    Clock::time_point last_ack;
  };
  struct Load {
    int32_t me = 0;
    std::map<int32_t, Window> to;
  };

  void end_locked(std::string load, const Status& why);

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Load> loads_;
  std::map<int32_t, Status> failed_;
  Status every_failed_;  // set by fail_rank(..., every): no window opens again
  // Loads that ended lately, with why: a waiter woken by the end reports it,
  // and acks still in flight for them are not mistaken for forged ones.
  std::deque<std::pair<std::string, Status>> ended_;
  // Refusals of loads not open here yet: (load, receiver, why), the last few.
  struct Refusal {
    std::string load;
    int32_t from;
    Status why;
  };
  std::deque<Refusal> early_;
  std::atomic<uint64_t> relayed_{0};
  std::atomic<uint64_t> in_memory_{0};
};

}  // namespace ferry
