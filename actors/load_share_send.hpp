// A reader's verified bytes sent on to the ranks that share them: the sender side of share rings.
#pragma once

#include <cstdint>

#include "actors/context.hpp"
#include "actors/messages.hpp"

namespace ferry {

// Sends the verified bytes of `op` (at `buf`) to the ranks in op.share_with,
// each only the elements of its box (its shared stream), in frames that
// carry their own checksum: the receiver cannot check part of a checksum
// block against the manifest. A frame's bytes are one stretch of the
// stream, copied from the buffer into the frame once, from wherever they lie
// (together for rows, apart for columns). The receivers' frames take turns, so all of them
// progress together. Each frame waits for room in the window toward its
// receiver (ShareWindows): the reader thread blocks there, and no queue
// grows past the windows.
Status send_shared(const RankContext& ctx, const ReadTask& task, const Manifest& m,
                   const ReadOp& op, const uint8_t* buf);

}  // namespace ferry
