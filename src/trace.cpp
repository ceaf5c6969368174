#include "trace.hpp"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <map>

#include "layout.hpp"  // json_string

namespace ferry {

int64_t trace_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

ClockOffset clock_offset(int64_t sent_ns, int64_t peer_ns, int64_t received_ns) {
  if (received_ns < sent_ns) std::swap(sent_ns, received_ns);
  const int64_t mid = sent_ns + (received_ns - sent_ns) / 2;
  return {peer_ns - mid, (received_ns - sent_ns + 1) / 2};
}

void PhaseClock::add(int64_t start_ns, int64_t end_ns, uint64_t bytes) {
  int64_t f = first_.load(std::memory_order_relaxed);
  while (start_ns < f && !first_.compare_exchange_weak(f, start_ns, std::memory_order_relaxed)) {
  }
  int64_t l = last_.load(std::memory_order_relaxed);
  while (end_ns > l && !last_.compare_exchange_weak(l, end_ns, std::memory_order_relaxed)) {
  }
  busy_.fetch_add(end_ns - start_ns, std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

TraceSpan PhaseClock::span(std::string name, std::string track, int64_t offset_ns) const {
  TraceSpan s;
  s.name = std::move(name);
  s.track = std::move(track);
  s.start_ns = first_.load(std::memory_order_relaxed) + offset_ns;
  s.end_ns = last_.load(std::memory_order_relaxed) + offset_ns;
  s.bytes = bytes_.load(std::memory_order_relaxed);
  s.busy_ms = static_cast<double>(busy_.load(std::memory_order_relaxed)) / 1e6;
  return s;
}

namespace {

int64_t first_start(const std::vector<RankTrace>& ranks) {
  int64_t t = std::numeric_limits<int64_t>::max();
  for (const RankTrace& r : ranks)
    for (const TraceSpan& s : r.spans) t = std::min(t, s.start_ns);
  return t == std::numeric_limits<int64_t>::max() ? 0 : t;
}

std::string us(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", static_cast<double>(ns) / 1e3);
  return buf;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", v);
  return buf;
}

void metadata(std::string& out, const char* name, int32_t pid, size_t tid, const std::string& key,
              const std::string& value_json) {
  out += ",\n{\"ph\":\"M\",\"name\":\"";
  out += name;
  out += "\",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"" +
         key + "\":" + value_json + "}}";
}

}  // namespace

Slowest slowest_rank(const std::vector<RankTrace>& ranks, const std::string& except_track) {
  Slowest out;
  int64_t latest = std::numeric_limits<int64_t>::min();
  for (const RankTrace& r : ranks)
    for (const TraceSpan& s : r.spans)
      if (s.track != except_track && s.end_ns > latest) {
        latest = s.end_ns;
        out.rank = r.rank;
        out.phase = s.name;
      }
  if (out.rank >= 0) out.ms = static_cast<double>(latest - first_start(ranks)) / 1e6;
  return out;
}

std::string render_chrome_trace(const TraceHeader& h, const std::vector<RankTrace>& ranks) {
  const int64_t t0 = first_start(ranks);
  const Slowest slow = slowest_rank(ranks, h.except_track);
  std::string out = "{\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"kind\":" + json_string(h.kind) +
                    ",\"id\":" + json_string(h.id) + ",\"step\":" + std::to_string(h.step) +
                    ",\"path\":" + json_string(h.path) +
                    ",\"ranks\":" + std::to_string(ranks.size()) +
                    ",\"slowest_rank\":" + std::to_string(slow.rank) +
                    ",\"slowest_phase\":" + json_string(slow.phase) +
                    ",\"slowest_ms\":" + num(slow.ms) + "},\n\"traceEvents\":[";
  // The first event has no leading comma; every later one starts with one.
  out += "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":-1,\"tid\":0,\"args\":{\"name\":" +
         json_string(h.kind + " " + h.id) + "}}";
  for (const RankTrace& r : ranks) {
    const std::string label =
        "rank " + std::to_string(r.rank) + (r.host.empty() ? "" : " (" + r.host + ")");
    metadata(out, "process_name", r.rank, 0, "name", json_string(label));
    metadata(out, "process_sort_index", r.rank, 0, "sort_index", std::to_string(r.rank));
    std::map<std::string, size_t> tids;
    for (const TraceSpan& s : r.spans) {
      auto [it, fresh] = tids.emplace(s.track, tids.size() + 1);
      if (fresh) {
        metadata(out, "thread_name", r.rank, it->second, "name", json_string(s.track));
        metadata(out, "thread_sort_index", r.rank, it->second, "sort_index",
                 std::to_string(it->second));
      }
      out += ",\n{\"ph\":\"X\",\"cat\":" + json_string(h.kind) +
             ",\"name\":" + json_string(s.name) + ",\"pid\":" + std::to_string(r.rank) +
             ",\"tid\":" + std::to_string(it->second) + ",\"ts\":" + us(s.start_ns - t0) +
             ",\"dur\":" + us(std::max<int64_t>(0, s.end_ns - s.start_ns)) +
             ",\"args\":{\"rank\":" + std::to_string(r.rank);
      if (s.bytes > 0) out += ",\"bytes\":" + std::to_string(s.bytes);
      if (s.busy_ms >= 0) out += ",\"busy_ms\":" + num(s.busy_ms);
      if (r.clock_error_ns > 0) out += ",\"clock_error_us\":" + us(r.clock_error_ns);
      out += "}}";
    }
  }
  if (slow.rank >= 0) {
    int64_t end = t0;
    for (const RankTrace& r : ranks)
      if (r.rank == slow.rank)
        for (const TraceSpan& s : r.spans)
          if (s.track != h.except_track) end = std::max(end, s.end_ns);
    out += ",\n{\"ph\":\"i\",\"s\":\"g\",\"name\":" +
           json_string("slowest: rank " + std::to_string(slow.rank) + " (" + slow.phase + ")") +
           ",\"pid\":" + std::to_string(slow.rank) + ",\"tid\":0,\"ts\":" + us(end - t0) + "}";
  }
  out += "\n]}\n";
  return out;
}

std::string trace_file_name(const TraceHeader& h) {
  std::string id;
  for (char c : h.id) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-';
    id += keep ? c : '_';
  }
  if (h.kind != "save") return h.kind + "-" + id + ".json";
  char step[32];
  std::snprintf(step, sizeof(step), "%08" PRIu64, h.step);
  return "save-" + std::string(step) + "-" + id + ".json";
}

std::string trace_dir_problem(const std::string& dir) {
  for (char c : dir)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      return "a directory path without control characters";
  if (dir.size() > 4000) return "a directory path shorter than 4000 bytes";
  return "";
}

Status write_trace_file(Filesystem& fs, const std::string& dir, const std::string& name,
                        const std::string& json) {
  const std::string path = join_path(dir, name);
  Status s = fs.mkdirs(dir);
  if (s.ok()) s = write_file_atomic(fs, path, json, /*sync=*/false);
  if (!s.ok()) return s.with_context("trace-dir: writing the timeline " + path + ": ");
  return Status();
}

}  // namespace ferry
