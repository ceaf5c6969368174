// Flag values in the settings' syntax: the `ferry` CLI's and the benches'
// (CLI11) and the hand-parsed test workers' flags read sizes as pool-bytes
// does ("64MiB", "1GiB", "4096"), through ferry::parse_size.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

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

// For a size in an environment variable: the bytes of `name`'s value, or
// `dflt` where it is unset or empty; a bad size prints "PROG: NAME: why" and
// exits with 2.
inline uint64_t env_size_or_exit(const char* prog, const char* name, uint64_t dflt,
                                 bool positive = true) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? size_flag_or_exit(prog, name, v, positive) : dflt;
}

// Adds `--NAME N` to `app`, a whole number above 0 into `*out`; a value
// past what `*out` holds is a CLI11 conversion error naming the flag.
template <class T>
CLI::Option* add_count_flag(CLI::App& app, const std::string& name, T* out,
                            const std::string& help) {
  return app.add_option(name, *out, help)->check(positive_count())->type_name("N");
}

// A `--set` value: KEY=VALUE with a key.
inline CLI::Validator setting_check() {
  return CLI::Validator(
      [](std::string& kv) -> std::string {
        const auto eq = kv.find('=');
        return eq == std::string::npos || eq == 0 ? "needs KEY=VALUE, got '" + kv + "'" : "";
      },
      "");
}

// Adds `--set KEY=VALUE`, any number of times, each kept in order in `*sets`.
inline CLI::Option* add_set_flag(CLI::App& app, std::vector<std::string>* sets,
                                 const std::string& help) {
  return app.add_option("--set", *sets, help)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->check(setting_check())
      ->type_name("KEY=VALUE");
}

// The same, each split into {KEY, VALUE} in `*settings`.
inline CLI::Option* add_set_flag(CLI::App& app,
                                 std::vector<std::pair<std::string, std::string>>* settings,
                                 const std::string& help) {
  return app
      .add_option_function<std::vector<std::string>>(
          "--set",
          [settings](const std::vector<std::string>& kvs) {
            for (const std::string& kv : kvs) {
              const auto eq = kv.find('=');
              settings->emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
            }
          },
          help)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->check(setting_check())
      ->type_name("KEY=VALUE");
}

// Parses a bench's argv with `app`: --help prints the generated help and
// exits 0; a usage error prints "PROG: why" (CLI11's message names the
// flag), and exits with 2.
inline void parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) std::exit(app.exit(e));
    std::fprintf(stderr, "%s: %s\n(%s --help shows its usage)\n", app.get_name().c_str(), e.what(),
                 app.get_name().c_str());
    std::exit(2);
  }
}

}  // namespace ferry::cli
