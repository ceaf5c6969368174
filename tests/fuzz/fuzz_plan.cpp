// libFuzzer target for the public planner's byte forms
// (LocalSavePlan::from_bytes, SavePlan::from_bytes in ferry/planner.hpp, and
// decode_save_plans, every rank's plans as rank 0 sends them).
//
// Invariants checked on every input, for each of the three decoders:
//  - it returns (a plan or a non-ok Status with a message) without crashing,
//    within the per-input time limit of fuzz_guard.hpp;
//  - a decoded plan round-trips: e1 = encode(decode(input)) decodes again,
//    and encoding that gives e1 byte for byte;
//  - to_string() of a decoded plan works (it indexes files by the writes).

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_guard.hpp"
#include "planner_api.hpp"

namespace {

constexpr const char* kTarget = "fuzz_plan";

template <class T, class Decode, class Encode>
void check(const std::string& input, const char* what, Decode decode, Encode encode) {
  ferry::Result<T> first = decode(input);
  if (!first.ok()) {
    if (first.status().message().empty())
      ferry::fuzz::fail(kTarget, std::string(what) + ": an error without a message");
    return;
  }
  const std::string e1 = encode(first.value());
  ferry::Result<T> second = decode(e1);
  if (!second.ok())
    ferry::fuzz::fail(kTarget,
                      std::string("a decoded ") + what +
                          ", encoded again, does not decode: " + second.status().to_string());
  if (encode(second.value()) != e1)
    ferry::fuzz::fail(kTarget, std::string("encode(decode(encode(p))) differs for a ") + what);
}

std::string text_of(const ferry::LocalSavePlan& p) {
  return p.to_string();
}
std::string text_of(const ferry::SavePlan& p) {
  return p.to_string();
}
std::string text_of(const std::vector<ferry::SavePlan>& ps) {
  std::string s;
  for (const auto& p : ps) s += p.to_string();
  return s;
}

}  // namespace

static int one_input(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  auto local = [](const std::string& b) { return ferry::LocalSavePlan::from_bytes(b); };
  auto rank = [](const std::string& b) { return ferry::SavePlan::from_bytes(b); };
  auto bytes = [](const auto& p) {
    (void)text_of(p);
    return p.to_bytes();
  };
  check<ferry::LocalSavePlan>(input, "local plan", local, bytes);
  check<ferry::SavePlan>(input, "save plan", rank, bytes);
  check<std::vector<ferry::SavePlan>>(
      input, "global plan", [](const std::string& b) { return ferry::decode_save_plans(b); },
      [](const std::vector<ferry::SavePlan>& ps) {
        (void)text_of(ps);
        return ferry::encode_save_plans(ps);
      });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ferry::fuzz::timed(kTarget, data, size, one_input);
}
