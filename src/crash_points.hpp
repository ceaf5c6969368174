// Crash points: the named steps of the save and load protocol at which a
// crash must leave the new checkpoint whole or the previous one intact. The
// core announces each through Filesystem::crash_point (a no-op unless a
// drill or a test wrapped the filesystem to observe it; the drills'
// KillPointFilesystem crashes there, src/drills/kill_point.hpp).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"

namespace ferry {

// write_file_atomic and write_temp_file announcing `points` ("manifest"):
// <points>.write, .fsync, and for the whole write .rename and .dirsync.
Status write_file_atomic_passing(Filesystem& fs, const std::string& path, const std::string& bytes,
                                 bool sync, const char* points);
Result<std::string> write_temp_file_passing(Filesystem& fs, const std::string& path,
                                            const std::string& bytes, bool sync,
                                            const char* points);
// The same, the file's bytes given as pieces that follow each other (a
// frame and a message kept elsewhere), so none is copied to join them.
Status write_pieces_atomic_passing(Filesystem& fs, const std::string& path,
                                   const std::vector<std::string_view>& pieces, bool sync,
                                   const char* points);

}  // namespace ferry
