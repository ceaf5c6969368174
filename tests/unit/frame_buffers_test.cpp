// FrameBuffers: large frame buffers are used again, small ones and those past
// the cap are not, and a frame built in a used buffer holds exactly its own
// bytes (nothing of the frame that buffer held before); two owners (two
// runtimes) never take each other's buffers.

#include "frame_buffers.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <variant>

#include "protocol.hpp"

using ferry::BlockShareMsg;
using ferry::FrameBuffers;

TEST_CASE("a large frame buffer given back serves the next frame and small ones are not kept",
          "[protocol]") {
  auto owned = std::make_shared<FrameBuffers>();
  FrameBuffers& fb = *owned;

  std::string big = fb.take(1 << 20);
  REQUIRE(big.size() == (1u << 20));
  const char* at = big.data();
  fb.give(std::move(big));
  CHECK(fb.kept_bytes() >= (1u << 20));
  std::string again = fb.take(512 << 10);
  CHECK(again.size() == (512u << 10));
  CHECK(again.data() == at);  // the same memory, already touched
  CHECK(fb.kept_bytes() == 0);

  fb.give(std::string(FrameBuffers::kMinBytes / 2, 'x'));
  CHECK(fb.kept_bytes() == 0);

  // Never more than the cap, however many come back.
  for (int i = 0; i < 64; ++i) fb.give(std::string(4 << 20, 'y'));
  CHECK(fb.kept_bytes() <= FrameBuffers::kMaxKeptBytes);
  CHECK(fb.kept_bytes() >= FrameBuffers::kMaxKeptBytes - (4u << 20) - 64);

  SECTION("a used buffer taken for no more than it held is not written again") {
    while (fb.kept_bytes() > 0) (void)fb.take(FrameBuffers::kMinBytes);
    std::string frame(1 << 20, 'f');
    frame[(1 << 20) - 1] = 'e';
    const char* p = frame.data();
    fb.give(std::move(frame));
    std::string same = fb.take(1 << 20);
    REQUIRE(same.data() == p);
    // Its old bytes are there still: no zeroing pass over a buffer the
    // transport overwrites anyway.
    CHECK(same.find_first_not_of('f') == (1u << 20) - 1);
    fb.give(std::move(same));
    // Grown past its old size, only the new bytes are zeroed.
    std::string shorter = fb.take(300 << 10);
    REQUIRE(shorter.data() == p);
    fb.give(std::move(shorter));
    std::string grown = fb.take(512 << 10);
    REQUIRE(grown.data() == p);
    CHECK(grown.find_first_not_of('f') == (300u << 10));
    CHECK(grown.substr(300 << 10) == std::string(212 << 10, '\0'));
  }

  SECTION("frame_owner returns the buffer when its last holder lets go") {
    while (fb.kept_bytes() > 0) (void)fb.take(FrameBuffers::kMinBytes);
    std::string bytes(2 << 20, 'z');
    const char* p = bytes.data();
    auto owner = ferry::frame_owner(std::move(bytes), owned);
    auto second = owner;
    owner.reset();
    CHECK(fb.kept_bytes() == 0);  // still held
    second.reset();
    CHECK(fb.kept_bytes() >= (2u << 20));
    CHECK(fb.take(2 << 20).data() == p);
  }
}

TEST_CASE("a BlockShare encoded into a used buffer decodes to its own bytes only", "[protocol]") {
  auto owned = std::make_shared<FrameBuffers>();
  FrameBuffers& fb = *owned;
  // A large frame first, given back as the transport does once it is sent.
  BlockShareMsg first{"job", "load-1", 1, 0, 0, 0, ferry::Status(), std::string(3 << 20, '\x11')};
  std::string sent = ferry::encode_message(first, &fb);
  fb.give(std::move(sent));
  // A smaller one, with bytes of its own and an odd length, in that buffer.
  std::string mine(1 << 20, '\0');
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<char>(i * 131 + 7);
  mine.push_back('\x5a');
  BlockShareMsg second{"job", "load-2", 2, 1, 3, 4096, ferry::Status(), mine};
  std::string frame = ferry::encode_message(second, &fb);
  // Received into a used buffer, as the transport does for a large frame.
  std::string received = fb.take(frame.size());
  std::memcpy(received.data(), frame.data(), frame.size());
  fb.give(std::move(frame));
  auto back = ferry::decode_message(ferry::frame_owner(std::move(received), owned));
  REQUIRE(back.ok());
  const auto& got = std::get<BlockShareMsg>(*back);
  CHECK(got.load_id == "load-2");
  CHECK(got.offset == 4096);
  CHECK(got.data.view() == mine);
}

TEST_CASE("two owners of frame buffers never take each other's buffers", "[protocol]") {
  // As two runtimes in one process: each encodes and receives through its own.
  auto a = std::make_shared<FrameBuffers>();
  auto b = std::make_shared<FrameBuffers>();
  BlockShareMsg big{"job", "load-1", 1, 0, 0, 0, ferry::Status(), std::string(1 << 20, 'a')};
  std::string sent = ferry::encode_message(big, a.get());
  const char* a_buffer = sent.data();
  a->give(std::move(sent));
  REQUIRE(a->kept_bytes() >= (1u << 20));

  // b's frame is built in fresh memory: a's buffer stays a's.
  std::string other = ferry::encode_message(big, b.get());
  CHECK(other.data() != a_buffer);
  CHECK(a->kept_bytes() >= (1u << 20));
  CHECK(b->kept_bytes() == 0);

  // A frame received by b goes back to b when its holders let go.
  auto held = ferry::frame_owner(std::move(other), b);
  held.reset();
  CHECK(b->kept_bytes() >= (1u << 20));
  CHECK(ferry::encode_message(big, a.get()).data() == a_buffer);
  CHECK(a->kept_bytes() == 0);

  // Without an owner, nothing is kept anywhere.
  auto loose = ferry::frame_owner(ferry::encode_message(big), nullptr);
  loose.reset();
  CHECK(a->kept_bytes() == 0);
}
