#include "ferry/status.hpp"

#include <cstring>

namespace ferry {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::ok:
      return "ok";
    case StatusCode::invalid_argument:
      return "invalid_argument";
    case StatusCode::not_found:
      return "not_found";
    case StatusCode::already_exists:
      return "already_exists";
    case StatusCode::io_error:
      return "io_error";
    case StatusCode::corruption:
      return "corruption";
    case StatusCode::unsupported:
      return "unsupported";
    case StatusCode::busy:
      return "busy";
    case StatusCode::aborted:
      return "aborted";
    case StatusCode::timeout:
      return "timeout";
    case StatusCode::outcome_unknown:
      return "outcome_unknown";
    case StatusCode::internal:
      return "internal";
  }
  return "unknown";
}

Status Status::from_errno(int err, const std::string& op, const std::string& path) {
  std::string msg = op + " " + path + ": " + std::strerror(err);
  if (err == ENOENT) return not_found(msg);
  if (err == EEXIST || err == ENOTEMPTY) return already_exists(msg);
  return io_error(msg);
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& prefix) const {
  if (ok()) return *this;
  return Status(code_, prefix + message_);
}

StatusError::StatusError(Status status)
    : std::runtime_error(status.to_string()), status_(std::move(status)) {}

void throw_status_error(const Status& status) {
  throw StatusError(status);
}

}  // namespace ferry
