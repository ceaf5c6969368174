// printf-style messages into a Logger (ferry/logger.hpp): library code logs
// through the logger its owner was given, never straight to stderr.
#pragma once

#include "ferry/logger.hpp"

namespace ferry {

// Formats one line and hands it to `logger` (log_to_stderr when empty).
void log_printf(const Logger& logger, LogLevel level, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

}  // namespace ferry
