// Conversions between Ferry's C++ values and Cap'n Proto readers and
// builders, shared by the protocol, the manifest and the plan bytes.
#pragma once

#include <capnp/list.h>
#include <kj/string.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ferry::capnp_util {

inline kj::StringPtr text(const std::string& s) {
  return kj::StringPtr(s.c_str(), s.size());
}

inline std::string str(capnp::Text::Reader t) {
  return std::string(t.cStr(), t.size());
}

inline std::vector<int64_t> i64s(capnp::List<int64_t>::Reader l) {
  std::vector<int64_t> v;
  v.reserve(l.size());
  for (int64_t x : l) v.push_back(x);
  return v;
}

// Sets list[i] = values[i]; the list was initialized with values.size().
template <class ListBuilder, class Vector>
void fill(ListBuilder list, const Vector& values) {
  for (size_t i = 0; i < values.size(); ++i) list.set(static_cast<unsigned>(i), values[i]);
}

}  // namespace ferry::capnp_util
