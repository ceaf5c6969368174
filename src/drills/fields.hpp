// Parsing helpers shared by the journal reader and the FERRY_FAULTS spec
// parser, which both read fields the writer controls and reject anything
// else rather than guess. Internal to the drills library.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::drills {

// Decimal digits only (no sign, no spaces), without overflow.
inline bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

// Every field, empty ones included, so a position means the same thing in
// every line.
inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t i = 0;
  while (true) {
    size_t j = s.find(sep, i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

// "250us", "5ms", "1s": digits and a unit, without overflow.
inline bool parse_duration(const std::string& v, std::chrono::microseconds* out) {
  size_t digits = 0;
  while (digits < v.size() && v[digits] >= '0' && v[digits] <= '9') ++digits;
  uint64_t n = 0;
  if (digits == 0 || !parse_u64(v.substr(0, digits), &n)) return false;
  const std::string unit = v.substr(digits);
  uint64_t scale;
  if (unit == "us")
    scale = 1;
  else if (unit == "ms")
    scale = 1000;
  else if (unit == "s")
    scale = 1000 * 1000;
  else
    return false;
  if (n > UINT64_MAX / scale / 2) return false;
  *out = std::chrono::microseconds(static_cast<int64_t>(n * scale));
  return true;
}

}  // namespace ferry::drills
