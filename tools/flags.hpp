// Flag values in the settings' syntax: the `ferry` CLI's (CLI11) and the
// hand-parsed test workers' flags read sizes as pool-bytes does ("64MiB",
// "1GiB", "4096"), through ferry::parse_size.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ferry/size.hpp"

namespace ferry::cli {

// The bytes of a size flag, or why it is none (ferry::parse_size's
// message naming the text); `positive` refuses 0 too.
inline Result<uint64_t> size_flag_value(const std::string& text, bool positive) {
  auto bytes = parse_size(text);
  if (bytes.ok() && positive && *bytes == 0)
    return Status::invalid_argument("'" + text + "': the size must be positive");
  return bytes;
}

// For a hand-written parser: the bytes of `text`, given to flag `flag` of
// program `prog`; on a bad size prints "PROG: FLAG: why" and exits with 2,
// the exit code of a usage error.
inline uint64_t size_flag_or_exit(const char* prog, const std::string& flag,
                                  const std::string& text, bool positive = true) {
  auto bytes = size_flag_value(text, positive);
  if (!bytes.ok()) {
    std::fprintf(stderr, "%s: %s: %s\n", prog, flag.c_str(), bytes.status().message().c_str());
    std::exit(2);
  }
  return *bytes;
}

// Adds `--NAME SIZE` to `app`, its bytes to `*bytes`; a bad size is a
// CLI11 ValidationError naming the flag and the text.
inline CLI::Option* add_size_flag(CLI::App& app, const std::string& name, uint64_t* bytes,
                                  const std::string& help, bool positive = true) {
  // A transform: the option then reads the byte count it leaves behind.
  CLI::Validator to_bytes(
      [positive](std::string& text) -> std::string {
        auto v = size_flag_value(text, positive);
        if (!v.ok()) return v.status().message();
        text = std::to_string(*v);
        return {};
      },
      "");
  return app.add_option(name, *bytes, help)->transform(to_bytes)->type_name("SIZE");
}

// A CLI11 check: a whole number above 0 (a count of ranks, steps, MiB).
inline CLI::Validator positive_count() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const bool digits =
            !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
        if (!digits || text.find_first_not_of('0') == std::string::npos)
          return "'" + text + "' is not a whole number above 0";
        return {};
      },
      "");
}

}  // namespace ferry::cli
