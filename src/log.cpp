#include "log.hpp"

#include <cstdarg>
#include <cstdio>
#include <string>

namespace ferry {

void log_to_stderr(LogLevel, const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
}

void log_printf(const Logger& logger, LogLevel level, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  std::string line(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(line.data(), line.size() + 1, fmt, again);
  va_end(again);
  // One trailing newline at most: the line is handed over without it.
  if (!line.empty() && line.back() == '\n') line.pop_back();
  if (logger)
    logger(level, line);
  else
    log_to_stderr(level, line);
}

}  // namespace ferry
