// Compiled by the status_nodiscard test: with -DDROP_STATUS or
// -DDROP_RESULT an ignored Status / Result must not compile under -Werror.
#include "ferry/status.hpp"

ferry::Status make_status() {
  return ferry::Status::io_error("x");
}
ferry::Result<int> make_result() {
  return 1;
}

int main() {
#if defined(DROP_STATUS)
  make_status();
#elif defined(DROP_RESULT)
  make_result();
#else
  (void)make_status();  // spelled out: fine
  (void)make_result();
#endif
  return 0;
}
