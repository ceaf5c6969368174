// libFuzzer target for ferry::decode_message (src/include/ferry/protocol.hpp).
//
// Invariants checked on every input:
//  - decode_message returns (a message or a non-ok Status) without crashing,
//    within the per-input time limit of fuzz_guard.hpp;
//  - the accessors of a decoded message work (message_name, job and
//    checkpoint ids);
//  - a decoded message round-trips: e1 = encode(decode(input)) decodes again
//    to the same kind of message, and encoding that gives e1 byte for byte.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "fuzz_guard.hpp"
#include "protocol.hpp"

namespace {

constexpr const char* kTarget = "fuzz_protocol";

}  // namespace

static int one_input(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  ferry::Result<ferry::WireMessage> first = ferry::decode_message(input);
  if (!first.ok()) {
    if (first.status().message().empty())
      ferry::fuzz::fail(kTarget, "decode_message returned an error without a message");
    return 0;
  }
  const char* name = ferry::message_name(first.value());
  if (name == nullptr || *name == '\0') ferry::fuzz::fail(kTarget, "message_name is empty");
  const std::string job(ferry::message_job_id(first.value()));
  const std::string checkpoint(ferry::message_checkpoint_id(first.value()));

  const std::string e1 = ferry::encode_message(first.value());
  ferry::Result<ferry::WireMessage> second = ferry::decode_message(e1);
  if (!second.ok())
    ferry::fuzz::fail(kTarget,
                      std::string("a decoded ") + name +
                          ", encoded again, does not decode: " + second.status().to_string());
  if (second.value().index() != first.value().index())
    ferry::fuzz::fail(kTarget, std::string("a ") + name + " re-decodes as a " +
                                   ferry::message_name(second.value()));
  if (ferry::message_job_id(second.value()) != job ||
      ferry::message_checkpoint_id(second.value()) != checkpoint)
    ferry::fuzz::fail(kTarget, std::string("a ") + name + " changes its ids in a round trip");
  const std::string e2 = ferry::encode_message(second.value());
  if (e1 != e2)
    ferry::fuzz::fail(
        kTarget, std::string("encode(decode(encode(m))) differs from encode(m) for a ") + name +
                     ": " + std::to_string(e1.size()) + " vs " + std::to_string(e2.size()) +
                     " bytes");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ferry::fuzz::timed(kTarget, data, size, one_input);
}
