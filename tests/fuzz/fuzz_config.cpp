// libFuzzer target for ferry::parse_ini_settings and ferry::resolve_options
// (src/include/ferry/options.hpp).
//
// Every input is used twice:
//  - as the text of an INI file: parse_ini_settings, then resolve_options on
//    the settings it returns;
//  - as one setting given in code: the first byte picks a key of
//    option_infos(), the rest is its value, so the value parsers (sizes with
//    suffixes, booleans, durations, addresses) are fuzzed directly.
// Each must end in a value or a non-ok Status with a message, without
// crashing, within the per-input time limit of fuzz_guard.hpp.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/options.hpp"
#include "fuzz_guard.hpp"

namespace {

constexpr const char* kTarget = "fuzz_config";

template <class T>
void expect_message(const ferry::Result<T>& r, const char* what) {
  if (!r.ok() && r.status().message().empty())
    ferry::fuzz::fail(kTarget, std::string(what) + " returned an error without a message");
}

}  // namespace

static int one_input(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);

  ferry::Result<std::vector<ferry::Setting>> settings = ferry::parse_ini_settings(text, "fuzz.ini");
  expect_message(settings, "parse_ini_settings");
  if (settings.ok()) {
    for (const ferry::Setting& s : settings.value())
      if (s.origin.empty()) ferry::fuzz::fail(kTarget, "setting '" + s.key + "' has no origin");
    expect_message(ferry::resolve_options(settings.value()), "resolve_options (INI)");
  }

  const std::vector<ferry::OptionInfo>& infos = ferry::option_infos();
  if (size >= 1 && !infos.empty()) {
    const ferry::OptionInfo& info = infos[data[0] % infos.size()];
    const std::vector<ferry::Setting> one = {{info.key, text.substr(1), "code"}};
    expect_message(ferry::resolve_options(one), "resolve_options (code)");
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ferry::fuzz::timed(kTarget, data, size, one_input);
}
