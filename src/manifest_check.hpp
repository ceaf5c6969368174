// Rank 0's last look at the manifest it is about to commit: a manifest that
// a load would refuse is never committed (the save fails instead, naming
// the tensor and the file). Pure; the files themselves (present, of their
// recorded size) are checked by commit_checkpoint before the commit point.
#pragma once

#include "ferry/status.hpp"
#include "manifest.hpp"

namespace ferry {

// Every chunk against its file and itself (inside its file after the header,
// stored length = raw size or the end of its last frame, frames tiling the
// raw bytes, checksum counts), then the whole manifest through the load's
// own decode_manifest. Errors (internal: Ferry wrote something wrong) name
// the tensor, the chunk, the file and the rank that wrote it.
Status check_manifest_before_commit(const Manifest& m);

}  // namespace ferry
