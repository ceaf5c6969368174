// Where the library's messages go (a checkpoint committed with warnings,
// tensors a load left out, threads left running at shutdown): a level and
// one line. RuntimeArgs::logger takes one; the default prints to stderr.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "ferry/export_macro.hpp"

namespace ferry {

enum class LogLevel : uint8_t { debug = 0, info = 1, warning = 2, error = 3 };

// `message` is one line without its newline ("ferry[rank 0]: warning: ...").
// Called from any of Ferry's threads, several at once: it must be
// thread-safe and quick, and must not call into the runtime that logs.
using Logger = std::function<void(LogLevel level, const std::string& message)>;

// The default: `message` and a newline on stderr, whatever the level.
FERRY_EXPORT void log_to_stderr(LogLevel level, const std::string& message);

}  // namespace ferry
