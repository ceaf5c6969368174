// Parsing helpers shared by the journal reader and the FERRY_FAULTS spec
// parser, which both read fields the writer controls and reject anything
// else rather than guess. Internal to the drills library.
#pragma once

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

}  // namespace ferry::drills
