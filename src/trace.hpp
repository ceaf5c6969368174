// The timeline of one save or load (option trace-dir): every rank's phases as
// spans on rank 0's clock, written by rank 0 as a Chrome trace event file
// (Perfetto and chrome://tracing open it). The pure part: span types, the
// clock offset from one round trip, the slowest rank, the JSON. The actors
// only take times, send their spans with the messages that already go to
// rank 0 (CommitRequest, LoadOutcome), and rank 0 writes the file.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"

namespace ferry {

// The tracer's clock: this process's steady clock, in nanoseconds. A rank's
// time plus its offset (clock_offset) is rank 0's.
int64_t trace_now_ns();

struct TraceSpan {
  std::string name;      // the phase: "plan", "write <file>", "read", ...
  std::string track;     // the row of the rank it is drawn in ("save", "snapshot", a file)
  int64_t start_ns = 0;  // on rank 0's clock
  int64_t end_ns = 0;    // on rank 0's clock; >= start_ns
  uint64_t bytes = 0;    // bytes the phase moved; 0: not counted
  double busy_ms = -1;   // time spent working inside the span (summed over threads); < 0: none
  friend bool operator==(const TraceSpan& a, const TraceSpan& b) {
    return a.name == b.name && a.track == b.track && a.start_ns == b.start_ns &&
           a.end_ns == b.end_ns && a.bytes == b.bytes && a.busy_ms == b.busy_ms;
  }
};

// One rank's spans. Empty when the rank recorded none (tracing off).
struct RankTrace {
  int32_t rank = 0;
  std::string host;
  int64_t clock_error_ns = 0;  // how far its clock may be off rank 0's (half the join round trip)
  std::vector<TraceSpan> spans;
  bool empty() const { return spans.empty(); }
  friend bool operator==(const RankTrace& a, const RankTrace& b) {
    return a.rank == b.rank && a.host == b.host && a.clock_error_ns == b.clock_error_ns &&
           a.spans == b.spans;
  }
};

// A rank's clock against rank 0's from one round trip: the rank sent at
// `sent_ns` and heard back at `received_ns` (its clock), rank 0 read its
// clock at `peer_ns` in between. offset: add it to the rank's time;
// error: half the round trip, the most it can be off.
struct ClockOffset {
  int64_t offset_ns = 0;
  int64_t error_ns = 0;
};
ClockOffset clock_offset(int64_t sent_ns, int64_t peer_ns, int64_t received_ns);

// One kind of work (reads, checksum checks, sends) done by several threads
// over a load: the first start, the last end, the time summed and the
// bytes. Thread-safe and allocation-free.
class PhaseClock {
 public:
  void add(int64_t start_ns, int64_t end_ns, uint64_t bytes);
  bool used() const { return last_.load(std::memory_order_relaxed) > 0; }
  // The span from the first start to the last end, shifted by `offset_ns`.
  TraceSpan span(std::string name, std::string track, int64_t offset_ns) const;

 private:
  std::atomic<int64_t> first_{std::numeric_limits<int64_t>::max()};
  std::atomic<int64_t> last_{0};
  std::atomic<int64_t> busy_{0};
  std::atomic<uint64_t> bytes_{0};
};

// A load's work on one rank, as its reader threads do it (trace-dir set):
// reading the data files, checking checksums (and copying the checked bytes
// into the tensors), sending replicated bytes to other ranks of the node.
struct LoadClocks {
  PhaseClock read;
  PhaseClock verify;
  PhaseClock share;
};

// The rank whose own work (spans on tracks other than rank 0's "commit"
// track, `except_track`) ended last, and that span; rank -1 when no span.
struct Slowest {
  int32_t rank = -1;
  std::string phase;
  double ms = 0;  // from the first span of any rank to its end
};
Slowest slowest_rank(const std::vector<RankTrace>& ranks, const std::string& except_track);

// What the file says about the save or load it shows.
struct TraceHeader {
  std::string kind;  // "save" or "load"
  std::string id;    // the checkpoint or load id
  uint64_t step = 0;
  std::string path;          // the step directory
  std::string except_track;  // not counted for the slowest rank (rank 0's commit)
};

// The Chrome trace event JSON: one process per rank ("rank R (host)"), one
// thread per track, an "X" event per span (ts and dur in microseconds from
// the earliest span), the slowest rank as an instant event and in
// otherData.
std::string render_chrome_trace(const TraceHeader& h, const std::vector<RankTrace>& ranks);

// "save-00000012-<id>.json", "load-<id>.json": the id with anything but
// [A-Za-z0-9._-] replaced.
std::string trace_file_name(const TraceHeader& h);

// Why `dir` cannot be a trace-dir value ("" when it can): control
// characters, or longer than a path can be.
std::string trace_dir_problem(const std::string& dir);

// Writes `json` as `name` in `dir` (made if missing), atomically and without
// fsync (a timeline needs no durability). Errors name trace-dir and the path.
Status write_trace_file(Filesystem& fs, const std::string& dir, const std::string& name,
                        const std::string& json);

}  // namespace ferry
