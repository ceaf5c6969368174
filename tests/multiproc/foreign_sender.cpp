// ferry_foreign_sender: a process outside the job (on another emulated host
// in tests/multiproc/hosts_test.cpp) that throws every hostile payload of
// hostile.hpp, after a well-formed Ferry hello whose Join carries a wrong job
// token, at each ADDR:PORT, each on a connection of its own; then it keeps a
// slow connection (one byte, then nothing) and a few idle ones open on each
// until it reads "done" (or its stdin ends), so that the job works on with
// them.
//
//   ferry_foreign_sender ADDR:PORT...
//
// Prints "JOIN REFUSED by ADDR:PORT" where the wrong-token Join was answered
// with a refusal naming the token ("JOIN ignored by" elsewhere), "SENT P
// payloads on C connections to T ports" (C counts the connections the targets
// accepted), then "HELD H" once the held ones are open. Exit 0, or 1 on bad
// arguments.

#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "protocol.hpp"
#include "tests/multiproc/hostile.hpp"

namespace {

bool parse_target(const std::string& s, sockaddr_storage* out) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) return false;
  auto* in4 = reinterpret_cast<sockaddr_in*>(out);
  *out = {};
  in4->sin_family = AF_INET;
  in4->sin_port = htons(static_cast<uint16_t>(std::stoul(s.substr(colon + 1))));
  return inet_pton(AF_INET, s.substr(0, colon).c_str(), &in4->sin_addr) == 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<sockaddr_storage> targets;
  for (int i = 1; i < argc; ++i) {
    sockaddr_storage a{};
    if (!parse_target(argv[i], &a)) {
      std::fprintf(stderr, "foreign_sender: bad target '%s' (ADDR:PORT)\n", argv[i]);
      return 1;
    }
    targets.push_back(a);
  }
  if (targets.empty()) {
    std::fprintf(stderr, "usage: ferry_foreign_sender ADDR:PORT...\n");
    return 1;
  }
  // First, alone on each port, a hello right in all but the job token: it
  // reaches the runtime's accept(), whose refusal names the token.
  const std::string join = ferry::testing::ferry_hello(
      ferry::encode_message(ferry::JoinMsg{"intruder", "not-this-jobs-token", 1, 4, "intruder-host",
                                           static_cast<int64_t>(getpid())}),
      std::string(8, '\x42'));
  for (size_t i = 0; i < targets.size(); ++i) {
    ferry::testing::Connection c(targets[i]);
    c.write_all(join);
    std::string reply;
    const bool closed = c.ok() && c.closed_by_peer(10, &reply);
    const bool refused = reply.find("different job token") != std::string::npos;
    std::printf("JOIN %s by %s (%zu bytes back, %s)\n", refused ? "REFUSED" : "ignored",
                argv[i + 1], reply.size(), closed ? "closed" : "left open");
  }
  const auto payloads = ferry::testing::hostile_payloads();
  size_t sent = 0, connected = 0;
  for (const auto& to : targets) {
    for (const auto& [what, bytes] : payloads) {
      ferry::testing::Connection c(to);
      ++sent;
      if (!c.ok()) continue;
      ++connected;
      c.write_all(bytes);
    }
  }
  std::printf("SENT %zu payloads on %zu connections to %zu ports\n", sent, connected,
              targets.size());
  std::fflush(stdout);
  std::vector<ferry::testing::Connection> held;
  for (const auto& to : targets) {
    held.emplace_back(to);
    held.back().write_all("F");
    for (int i = 0; i < 4; ++i) held.emplace_back(to);
  }
  size_t open = 0;
  for (const auto& c : held) open += c.ok() ? 1 : 0;
  std::printf("HELD %zu\n", open);
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line) && line != "done") {
  }
  return 0;
}
