// libFuzzer target for ferry::decode_manifest (src/include/ferry/manifest.hpp).
//
// Invariants checked on every input:
//  - decode_manifest returns (a value or a non-ok Status) without crashing,
//    within the per-input time limit of fuzz_guard.hpp;
//  - a decoded manifest round-trips: e1 = encode(decode(input)) decodes again,
//    and encoding that second value gives e1 byte for byte.
//
// The frame carries an xxh3-64 of its payload, which random mutation almost
// never gets right, so each input is also decoded a second time with the
// frame's payload length and checksum recomputed: that copy reaches the Cap'n
// Proto payload and the semantic checks behind the checksum.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "checksum.hpp"
#include "fuzz_guard.hpp"
#include "manifest.hpp"

namespace {

constexpr const char* kTarget = "fuzz_manifest";

void check_round_trip(std::string_view bytes) {
  ferry::Result<ferry::Manifest> first = ferry::decode_manifest(bytes);
  if (!first.ok()) {
    if (first.status().message().empty())
      ferry::fuzz::fail(kTarget, "decode_manifest returned an error without a message");
    return;
  }
  const std::string e1 = ferry::encode_manifest(first.value());
  ferry::Result<ferry::Manifest> second = ferry::decode_manifest(e1);
  if (!second.ok())
    ferry::fuzz::fail(kTarget, "a decoded manifest, encoded again, does not decode: " +
                                   second.status().to_string());
  const std::string e2 = ferry::encode_manifest(second.value());
  if (e1 != e2)
    ferry::fuzz::fail(
        kTarget, "encode(decode(encode(m))) differs from encode(m): " + std::to_string(e1.size()) +
                     " vs " + std::to_string(e2.size()) + " bytes");
}

uint64_t get_le(std::string_view b, size_t pos, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(b[pos + i])) << (8 * i);
  return v;
}

void put_u64(std::string* s, size_t pos, uint64_t v) {
  for (size_t i = 0; i < 8; ++i) (*s)[pos + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// The input with its payload length and checksum made to match the bytes
// that follow them (frame layout: docs/format.md). False when the input is
// too short to hold a payload header or already matches.
bool fix_frame(std::string_view in, std::string* out) {
  size_t pos = 8 + 4;  // magic, format version
  if (in.size() < pos + 4) return false;
  const uint64_t features = get_le(in, pos, 4);
  pos += 4;
  for (uint64_t i = 0; i < features; ++i) {
    if (in.size() < pos + 2) return false;
    pos += 2 + get_le(in, pos, 2);
  }
  if (in.size() < pos + 16) return false;
  const size_t payload = pos + 16;
  const uint64_t len = in.size() - payload;
  const uint64_t sum = ferry::xxh3_64(in.data() + payload, len);
  if (get_le(in, pos, 8) == len && get_le(in, pos + 8, 8) == sum) return false;
  out->assign(in.data(), in.size());
  put_u64(out, pos, len);
  put_u64(out, pos + 8, sum);
  return true;
}

}  // namespace

static int one_input(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  check_round_trip(input);
  std::string fixed;
  if (fix_frame(input, &fixed)) check_round_trip(fixed);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ferry::fuzz::timed(kTarget, data, size, one_input);
}
