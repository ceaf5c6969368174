// A plain safetensors writer standing in for a user's checkpoint_fn (what
// safetensors' save_file does): entries in reverse order and no alignment,
// so Ferry cannot rely on its own layout when it reads the file back.
#pragma once

#include <cstdio>
#include <string>

#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry::testing {

inline Status write_safetensors(const StateDict& sd, const std::string& path) {
  std::string json = "{";
  std::string data;
  const auto& es = sd.entries();
  for (auto it = es.rbegin(); it != es.rend(); ++it) {
    const TensorView& v = it->view;
    std::string shape;
    for (int64_t d : v.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    json += (json.size() > 1 ? "," : "") + std::string("\"") + it->key + "\":{\"dtype\":\"" +
            dtype_name(v.dtype) + "\",\"shape\":[" + shape + "],\"data_offsets\":[" +
            std::to_string(data.size()) + "," + std::to_string(data.size() + v.nbytes()) + "]}";
    data.append(static_cast<const char*>(v.data), v.nbytes());
  }
  json += "}";
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<char>(static_cast<uint64_t>(json.size()) >> (8 * i));
  out += json + data;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return Status::io_error("cannot create " + path);
  const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
  return std::fclose(f) == 0 && ok ? Status() : Status::io_error("writing " + path);
}

}  // namespace ferry::testing
