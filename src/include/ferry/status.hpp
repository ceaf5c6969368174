// One error currency for all of Ferry: a Status (code + message naming the
// thing that is wrong) and Result<T> (a value or a Status). Both are
// [[nodiscard]]: an ignored error must be spelled `(void)`.
#pragma once

#include <cassert>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

#include "ferry/export_macro.hpp"

namespace ferry {

enum class StatusCode {
  ok = 0,
  invalid_argument,  // bad input from the caller: state dict, config, path
  not_found,
  already_exists,
  io_error,     // an OS call failed (ENOSPC, EIO, ...)
  corruption,   // bytes on disk disagree with the manifest
  unsupported,  // a format version or feature this build does not know
  busy,         // a save is in flight and the config says fail fast
  aborted,      // the checkpoint was abandoned (peer gone, phase failed)
  timeout,
  outcome_unknown,  // the coordinator vanished after the commit point
  internal,
};

FERRY_EXPORT const char* status_code_name(StatusCode code);

class [[nodiscard]] FERRY_EXPORT Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  static Status invalid_argument(std::string m) {
    return {StatusCode::invalid_argument, std::move(m)};
  }
  static Status not_found(std::string m) { return {StatusCode::not_found, std::move(m)}; }
  static Status already_exists(std::string m) { return {StatusCode::already_exists, std::move(m)}; }
  static Status io_error(std::string m) { return {StatusCode::io_error, std::move(m)}; }
  static Status corruption(std::string m) { return {StatusCode::corruption, std::move(m)}; }
  static Status unsupported(std::string m) { return {StatusCode::unsupported, std::move(m)}; }
  static Status busy(std::string m) { return {StatusCode::busy, std::move(m)}; }
  static Status aborted(std::string m) { return {StatusCode::aborted, std::move(m)}; }
  static Status timeout(std::string m) { return {StatusCode::timeout, std::move(m)}; }
  static Status outcome_unknown(std::string m) {
    return {StatusCode::outcome_unknown, std::move(m)};
  }
  static Status internal(std::string m) { return {StatusCode::internal, std::move(m)}; }
  // An OS failure: names the operation, the path and errno's text.
  static Status from_errno(int err, const std::string& op, const std::string& path);

  bool ok() const { return code_ == StatusCode::ok; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "io_error: pwrite /x/y: No space left on device"
  std::string to_string() const;

  // Prepends context ("rank 1: ") to the message, keeping the code.
  Status with_context(const std::string& prefix) const;

 private:
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

// What Result::value() throws when it holds an error instead of a value:
// what() is the Status's to_string() ("not_found: no checkpoint in /x"),
// status() the Status itself.
class FERRY_EXPORT StatusError : public std::runtime_error {
 public:
  explicit StatusError(Status status);
  const Status& status() const noexcept { return status_; }

 private:
  Status status_;
};

// Throws StatusError(status); out of line so that Result stays small.
[[noreturn]] FERRY_EXPORT void throw_status_error(const Status& status);

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).ok()); }  // NOLINT

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  // The value; on an error, throws StatusError carrying the Status (check
  // ok() first where an error is expected).
  T& value() & {
    if (!ok()) throw_status_error(std::get<Status>(v_));
    return std::get<T>(v_);
  }
  const T& value() const& {
    if (!ok()) throw_status_error(std::get<Status>(v_));
    return std::get<T>(v_);
  }
  T&& value() && {
    if (!ok()) throw_status_error(std::get<Status>(v_));
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ferry

#define FERRY_CONCAT_INNER(a, b) a##b
#define FERRY_CONCAT(a, b) FERRY_CONCAT_INNER(a, b)

// Returns early from the enclosing function with the Status if it is an error.
#define FERRY_RETURN_IF_ERROR(expr)        \
  do {                                     \
    ::ferry::Status _ferry_st = (expr);    \
    if (!_ferry_st.ok()) return _ferry_st; \
  } while (0)

// FERRY_ASSIGN_OR_RETURN(auto x, make_x()); returns the error if any.
#define FERRY_ASSIGN_OR_RETURN(lhs, rexpr) \
  FERRY_ASSIGN_OR_RETURN_IMPL(FERRY_CONCAT(_ferry_r, __LINE__), lhs, rexpr)
#define FERRY_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
