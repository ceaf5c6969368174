// ferry_transport_peer: a rank > 0 in its own process, driven by
// transport_test.cpp.
//
//   ferry_transport_peer --rank R --world W --port P [--host H]
//                        [--mode echo|kill-self|stop-self|bad-hello]
//                        [--connect-timeout S] [--hb-interval S] [--hb-timeout S]
//
// Every mode joins with the hello "hello R" (bad-hello: a hello rank 0 must
// refuse) and sends "hb" as heartbeat. After rank 0's first frame (the ack),
// each frame except "hb" is echoed back; kill-self SIGKILLs itself on "die",
// stop-self SIGSTOPs itself on "freeze" (a hung process, not a dead one).
// The process ends when rank 0 goes away or sends "bye".
//
// Exit codes: 0 done; 1 bad arguments; 2 wait_peers failed; 3 start failed;
// 4 bad-hello got no "refused" reply; 5 ran longer than its safety limit.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "actors/transport.hpp"

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
    } else {
      std::fprintf(stderr, "transport_peer: unknown argument %s\n", key.c_str());
      return false;
    }
  }
  return a->mode == "echo" || a->mode == "kill-self" || a->mode == "stop-self" ||
         a->mode == "bad-hello";
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

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool got_ack = false;
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
  bool finished = cv.wait_for(lock, std::chrono::seconds(60), [&] { return done; });
  lock.unlock();
  t->stop();
  return finished ? 0 : 5;
}
