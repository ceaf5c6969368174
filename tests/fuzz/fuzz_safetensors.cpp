// libFuzzer target for ferry::parse_safetensors_header
// (src/include/ferry/layout.hpp).
//
// An input is a whole safetensors file: 8-byte little-endian header length,
// JSON header, data. It is parsed as a file of its own size, and again as the
// prefix of a larger file (the data running past the input) and with the
// size fields at their extremes, so the length arithmetic sees hostile
// values. Each call must end in a value or a non-ok Status with a message,
// without crashing, within the per-input time limit of fuzz_guard.hpp; an
// accepted header must describe entries that tile the data exactly.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "fuzz_guard.hpp"
#include "layout.hpp"

namespace {

constexpr const char* kTarget = "fuzz_safetensors";

void parse(const std::string& prefix, uint64_t file_size) {
  ferry::Result<ferry::SafetensorsHeader> h = ferry::parse_safetensors_header(prefix, file_size);
  if (!h.ok()) {
    if (h.status().message().empty())
      ferry::fuzz::fail(kTarget, "parse_safetensors_header returned an error without a message");
    return;
  }
  if (h->data_start < 8 || h->data_start > file_size || h->data_start > prefix.size())
    ferry::fuzz::fail(kTarget, "accepted a header whose data start " +
                                   std::to_string(h->data_start) + " lies outside the " +
                                   std::to_string(file_size) + "-byte file");
  uint64_t expected = 0;
  for (const ferry::SafetensorsEntry& e : h->entries) {
    if (e.begin != expected || e.end < e.begin)
      ferry::fuzz::fail(kTarget, "accepted entries that do not tile the data ('" + e.name + "')");
    expected = e.end;
  }
  if (expected != file_size - h->data_start)
    ferry::fuzz::fail(kTarget, "accepted entries covering " + std::to_string(expected) +
                                   " bytes of a " + std::to_string(file_size) + "-byte file");
}

}  // namespace

static int one_input(const uint8_t* data, size_t size) {
  const std::string file(reinterpret_cast<const char*>(data), size);
  parse(file, size);
  parse(file, static_cast<uint64_t>(size) + 4096);
  parse(file, std::numeric_limits<uint64_t>::max());
  parse(file, size > 8 ? size - 1 : 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ferry::fuzz::timed(kTarget, data, size, one_input);
}
