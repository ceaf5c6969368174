// ferry_transport_peer: one rank in its own process, driven by
// transport_test.cpp.
//
//   ferry_transport_peer --rank R --world W --port P [--host H]
//                        [--mode echo|kill-self|stop-self|bad-hello|serve|lane]
//                        [--connect-timeout S] [--hb-interval S] [--hb-timeout S]
//                        [--handshake-timeout S] [--max-frame SIZE]
//                        [--lanes shm|tcp|off] [--node NAME]
//
// Ranks > 0: every mode joins with the hello "hello R" (bad-hello: a hello
// rank 0 must refuse) and sends "hb" as heartbeat. After rank 0's first frame
// (the ack), each frame except "hb" is echoed back, except "send N", answered
// with N bytes of 'x'; kill-self SIGKILLs itself on "die", stop-self SIGSTOPs
// itself on "freeze" (a hung process, not a dead one). The process ends when
// rank 0 goes away or sends "bye".
//
// lane: the direct lanes between ranks > 0. Commands from rank 0: "to S TEXT"
// sends TEXT to rank S (on the lane), "forge S TEXT" sends it on the lane
// with a made-up session, "flood S N" sends N frames of 1 MiB, "close S"
// closes the lane (answered "closed S"), "info S" is answered "info S:
// <lane_info>", "die" SIGKILLs this process; a failed send is answered
// "no lane: <error>"; "waitlanes" is answered, once wait_lanes() returned, with
// "lanes ok" (or its error) and a line "S: <lane_info>" per other rank S > 0.
// A frame from another rank S is reported to rank 0 as
// "from S: TEXT" (frames over 64 bytes as "from S: N bytes"). Anything else
// from rank 0 is echoed.
//
// serve (rank 0, so that a test can watch it from outside: its listening
// sockets, its memory, whether it is alive): accepts "hello N" as rank N,
// prints "port P" once listening and "joined" once every rank is in; then
// reads commands on stdin: "exchange" pings every rank, waits for the echoes
// and prints "exchanged"; "quit" (or end of input) says bye and exits.
//
// Exit codes: 0 done; 1 bad arguments; 2 wait_peers failed; 3 start failed;
// 4 bad-hello got no "refused" reply; 5 ran longer than its safety limit;
// 6 serve: an echo did not come back.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <string>

#include "actors/transport.hpp"
#include "tools/flags.hpp"

namespace {

struct Args {
  ferry::TransportOptions opts;
  std::string mode = "echo";
};

bool parse(int argc, char** argv, Args* a) {
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string key = argv[i];
    const char* v = argv[i + 1];
    if (key == "--rank") {
      a->opts.rank = std::atoi(v);
    } else if (key == "--world") {
      a->opts.world_size = std::atoi(v);
    } else if (key == "--port") {
      a->opts.port = static_cast<uint16_t>(std::atoi(v));
    } else if (key == "--host") {
      a->opts.host = v;
    } else if (key == "--mode") {
      a->mode = v;
    } else if (key == "--connect-timeout") {
      a->opts.connect_timeout_s = std::atof(v);
    } else if (key == "--hb-interval") {
      a->opts.heartbeat_interval_s = std::atof(v);
    } else if (key == "--hb-timeout") {
      a->opts.heartbeat_timeout_s = std::atof(v);
    } else if (key == "--handshake-timeout") {
      a->opts.handshake_timeout_s = std::atof(v);
    } else if (key == "--max-frame") {
      a->opts.max_frame_bytes = ferry::cli::size_flag_or_exit("transport_peer", key, v);
    } else if (key == "--lanes") {
      a->opts.lanes = v;
    } else if (key == "--node") {
      a->opts.node = v;
    } else {
      std::fprintf(stderr, "transport_peer: unknown argument %s\n", key.c_str());
      return false;
    }
  }
  return a->mode == "echo" || a->mode == "kill-self" || a->mode == "stop-self" ||
         a->mode == "bad-hello" || a->mode == "serve" || a->mode == "lane";
}

int serve(const ferry::TransportOptions& opts) {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int32_t, std::string> echoed;
  ferry::TransportCallbacks cb;
  cb.accept = [](const std::string& hello, std::string* reply) -> ferry::Result<int32_t> {
    if (hello.rfind("hello ", 0) != 0) {
      *reply = "refused";
      return ferry::Status::invalid_argument("bad hello");
    }
    *reply = "ack";
    return std::atoi(hello.c_str() + 6);
  };
  cb.on_frame = [&](int32_t from, std::string frame) {
    if (frame == "hb") return;
    std::lock_guard<std::mutex> lock(mu);
    echoed[from] = std::move(frame);
    cv.notify_all();
  };
  cb.on_peer_failed = [](int32_t rank, ferry::Status why) {
    std::fprintf(stderr, "serve: rank %d failed: %s\n", rank, why.to_string().c_str());
  };
  auto started = ferry::Transport::start(opts, "", "hb", cb);
  if (!started.ok()) {
    std::fprintf(stderr, "serve: %s\n", started.status().to_string().c_str());
    return 3;
  }
  std::unique_ptr<ferry::Transport> t = std::move(started).value();
  std::printf("port %u\n", static_cast<unsigned>(t->port()));
  std::fflush(stdout);
  ferry::Status st = t->wait_peers(opts.connect_timeout_s);
  if (!st.ok()) {
    std::fprintf(stderr, "serve: wait_peers: %s\n", st.to_string().c_str());
    return 2;
  }
  std::printf("joined\n");
  std::fflush(stdout);
  int round = 0;
  std::string line;
  while (std::getline(std::cin, line) && line != "quit") {
    if (line != "exchange") continue;
    const std::string ping = "ping " + std::to_string(++round);
    for (int32_t r = 1; r < opts.world_size; ++r) {
      if (!t->send(r, ping).ok()) return 6;
    }
    std::unique_lock<std::mutex> lock(mu);
    bool all = cv.wait_for(lock, std::chrono::seconds(60), [&] {
      for (int32_t r = 1; r < opts.world_size; ++r) {
        if (echoed[r] != ping) return false;
      }
      return true;
    });
    if (!all) return 6;
    std::printf("exchanged\n");
    std::fflush(stdout);
  }
  for (int32_t r = 1; r < opts.world_size; ++r) (void)t->send(r, "bye");
  t->stop();
  return 0;
}

// lane mode: one frame; rank 0's commands, other ranks' frames reported.
void on_lane_frame(ferry::Transport& t, int32_t from, const std::string& frame) {
  auto report = [&](const std::string& what) {
    ferry::Status st = t.send(0, what);
    if (!st.ok()) std::fprintf(stderr, "lane peer: report: %s\n", st.to_string().c_str());
  };
  if (from != 0) {
    report("from " + std::to_string(from) + ": " +
           (frame.size() > 64 ? std::to_string(frame.size()) + " bytes" : frame));
    return;
  }
  // "<verb> <rank> <rest>"
  const size_t sp1 = frame.find(' ');
  const std::string verb = frame.substr(0, sp1);
  const int32_t to = sp1 == std::string::npos ? -1 : std::atoi(frame.c_str() + sp1 + 1);
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : frame.find(' ', sp1 + 1);
  const std::string rest = sp2 == std::string::npos ? "" : frame.substr(sp2 + 1);
  ferry::Status st;
  if (verb == "die") {
    raise(SIGKILL);
  } else if (verb == "to") {
    st = t.send(to, rest);
  } else if (verb == "forge") {
    st = t.send_on_lane_for_test(to, 0x5eed5eed5eed5eedull, rest);
  } else if (verb == "flood") {
    for (int i = 0, n = std::atoi(rest.c_str()); i < n && st.ok(); ++i)
      st = t.send(to, std::string(1 << 20, 'f'));
  } else if (verb == "close") {
    t.close_lane(to, ferry::Status::aborted("rank " + std::to_string(to) + " failed (test)"));
    return report("closed " + std::to_string(to));
  } else if (verb == "info") {
    return report("info " + std::to_string(to) + ": " + t.lane_info(to));
  } else {
    st = t.send(0, frame);
  }
  if (!st.ok()) report("no lane: " + st.to_string());
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if ((argc % 2) != 1 || !parse(argc, argv, &args)) {
    std::fprintf(stderr, "usage: %s --rank R --world W --port P [--mode M] ...\n", argv[0]);
    return 1;
  }
  const int32_t rank = args.opts.rank;
  const std::string mode = args.mode;
  if (mode == "serve") return serve(args.opts);

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool got_ack = false;
  bool lanes_asked = false;  // lane mode: "waitlanes" came, answered from the main thread
  std::string first_frame;
  ferry::Transport* transport = nullptr;  // set before any frame can arrive

  ferry::TransportCallbacks cb;
  cb.on_frame = [&](int32_t from, std::string frame) {
    if (frame == "hb") return;
    std::unique_lock<std::mutex> lock(mu);
    if (!got_ack) {
      got_ack = true;
      first_frame = frame;
      cv.notify_all();
      return;
    }
    if (frame == "bye") {
      done = true;
      cv.notify_all();
      return;
    }
    ferry::Transport* tp = transport;
    lock.unlock();
    if (mode == "kill-self" && frame == "die") raise(SIGKILL);
    if (mode == "stop-self" && frame == "freeze") {
      raise(SIGSTOP);
      return;
    }
    if (tp == nullptr) return;
    if (mode == "lane" && from == 0 && frame == "waitlanes") {
      // wait_lanes blocks, which a callback must not: the main thread runs it.
      std::lock_guard<std::mutex> relock(mu);
      lanes_asked = true;
      cv.notify_all();
      return;
    }
    if (mode == "lane") return on_lane_frame(*tp, from, frame);
    if (frame.rfind("send ", 0) == 0)
      frame.assign(std::strtoull(frame.c_str() + 5, nullptr, 10), 'x');
    ferry::Status st = tp->send(from, std::move(frame));
    if (!st.ok()) std::fprintf(stderr, "peer %d: echo: %s\n", rank, st.to_string().c_str());
  };
  cb.on_peer_failed = [&](int32_t, ferry::Status) {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    cv.notify_all();
  };

  std::string hello = mode == "bad-hello" ? "not a join" : "hello " + std::to_string(rank);
  auto started = ferry::Transport::start(args.opts, hello, "hb", cb);
  if (!started.ok()) {
    std::fprintf(stderr, "peer %d: %s\n", rank, started.status().to_string().c_str());
    return 3;
  }
  std::unique_ptr<ferry::Transport> t = std::move(started).value();
  {
    // on_frame may already run (the ack): publish the pointer under the lock.
    std::lock_guard<std::mutex> lock(mu);
    transport = t.get();
  }
  ferry::Status st = t->wait_peers(args.opts.connect_timeout_s + 5);
  if (!st.ok()) {
    std::fprintf(stderr, "peer %d: wait_peers: %s\n", rank, st.to_string().c_str());
    return 2;
  }
  std::unique_lock<std::mutex> lock(mu);
  if (mode == "bad-hello") {
    bool refused = first_frame == "refused";
    lock.unlock();
    t->stop();
    return refused ? 0 : 4;
  }
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool finished = false;
  while (cv.wait_until(lock, limit, [&] { return done || lanes_asked; })) {
    if (done) {
      finished = true;
      break;
    }
    lanes_asked = false;
    lock.unlock();
    const ferry::Status st = t->wait_lanes(10);
    std::string answer = "lanes " + (st.ok() ? std::string("ok") : st.to_string());
    for (int32_t r = 1; r < args.opts.world_size; ++r)
      if (r != rank) answer += "\n" + std::to_string(r) + ": " + t->lane_info(r);
    (void)t->send(0, answer);
    lock.lock();
  }
  lock.unlock();
  t->stop();
  return finished ? 0 : 5;
}
