// Status and Result: value() on an error throws StatusError carrying the
// Status, so the message reaches whoever catches (or std::terminate's line).

#include <catch2/catch.hpp>

#include <string>
#include <type_traits>

#include "ferry/status.hpp"

namespace {

ferry::Result<int> failing() {
  return ferry::Status::not_found("no checkpoint under /ckpt/run-7");
}

}  // namespace

TEST_CASE("value() on an error throws StatusError with the status text", "[status]") {
  ferry::Result<int> r = failing();
  REQUIRE_FALSE(r.ok());
  try {
    (void)r.value();
    FAIL("value() returned on an error");
  } catch (const ferry::StatusError& e) {
    CHECK(std::string(e.what()) == "not_found: no checkpoint under /ckpt/run-7");
    CHECK(e.status().code() == ferry::StatusCode::not_found);
    CHECK(e.status().message() == "no checkpoint under /ckpt/run-7");
  }
  // Every way to the value: const, rvalue, * and ->.
  const ferry::Result<int>& cr = r;
  CHECK_THROWS_AS(cr.value(), ferry::StatusError);
  CHECK_THROWS_WITH(failing().value(), "not_found: no checkpoint under /ckpt/run-7");
  CHECK_THROWS_AS(*r, ferry::StatusError);
  ferry::Result<std::string> s = ferry::Status::io_error("pwrite /x: No space left on device");
  CHECK_THROWS_WITH(s->size(), "io_error: pwrite /x: No space left on device");
  // A std::runtime_error, so a generic handler still prints the text.
  static_assert(std::is_base_of_v<std::runtime_error, ferry::StatusError>);
}

TEST_CASE("value() on a value returns it", "[status]") {
  ferry::Result<std::string> r = std::string("step-00000003");
  CHECK(r.value() == "step-00000003");
  CHECK(r->size() == 13);
  CHECK(std::move(r).value() == "step-00000003");
}
