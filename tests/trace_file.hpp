// Reading a timeline file (trace-dir) in tests: Python's json module parses
// it (so the file is JSON a standard parser takes), and prints its spans,
// which the test then checks.
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "process.hpp"

namespace ferry::testing {

struct TracedSpan {
  int rank = 0;
  int64_t start_ns = 0;  // from the earliest span of the file
  int64_t end_ns = 0;
  int64_t clock_error_ns = 0;
  std::string name;
};

struct TraceFile {
  std::string kind;
  int slowest_rank = -1;
  std::string slowest_phase;
  std::vector<TracedSpan> spans;  // in file order
  // Rank `rank`'s span called `name`, or null.
  const TracedSpan* find(int rank, const std::string& name) const {
    for (const auto& s : spans)
      if (s.rank == rank && s.name == name) return &s;
    return nullptr;
  }
};

inline TraceFile read_trace_file(const std::string& path) {
  static const char* kScript =
      "import json, sys\n"
      "d = json.load(open(sys.argv[1]))\n"
      "o = d['otherData']\n"
      "print('KIND', o['kind'])\n"
      "print('SLOWEST', o['slowest_rank'], o['slowest_phase'])\n"
      "for e in d['traceEvents']:\n"
      "    if e['ph'] == 'X':\n"
      "        a = e['args']\n"
      "        print('SPAN', e['pid'], round(e['ts'] * 1000), round((e['ts'] + e['dur']) * 1000),\n"
      "              round(a.get('clock_error_us', 0) * 1000), e['name'])\n";
  const RunResult r = run({"/usr/bin/python3", "-c", kScript, path});
  INFO("python3 reading " << path << ": " << r.out);
  REQUIRE(r.code == 0);
  TraceFile t;
  for (const std::string& line : lines_of(r.out)) {
    std::istringstream in(line);
    std::string what;
    in >> what;
    if (what == "KIND") in >> t.kind;
    if (what == "SLOWEST") {
      in >> t.slowest_rank >> std::ws;
      std::getline(in, t.slowest_phase);
    }
    if (what == "SPAN") {
      TracedSpan s;
      in >> s.rank >> s.start_ns >> s.end_ns >> s.clock_error_ns >> std::ws;
      std::getline(in, s.name);
      t.spans.push_back(std::move(s));
    }
  }
  return t;
}

// The files in `dir` whose names start with `prefix`.
inline std::vector<std::string> files_starting(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().string());
  return out;
}

}  // namespace ferry::testing
