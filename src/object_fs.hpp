// Object-store roots ("s3://bucket/prefix") behind the Filesystem interface,
// so the writer, the loader and the catalog run one code path for both kinds
// of roots. Only the commit differs (commit.cpp): S3 has no rename, so a
// save's data objects go straight under the step's prefix, in a sub-prefix
// of their own, and the step's MANIFEST, created only if absent, is the
// commit point (docs/format.md, "Object-store roots").
//
// What the mapping gives the rest of Ferry: a "directory" is a key prefix
// (it exists while an object lies under it; mkdir, rmdir and sync_dir do
// nothing); a file opened for writing is an ObjectWriter (multipart, its
// parts sent as they fill, several at once through AsyncWriteFile, nothing
// visible before truncate() gives its size);
// a temporary file (write_temp_file's ".tmp-" names) stays in memory until
// it is renamed, which puts it as one object (rename_noreplace: only if
// absent); reads are ranged GETs. Renaming anything else, and locks across
// processes, are not offered: the commit on an object root needs neither.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "ferry/filesystem.hpp"
#include "ferry/options.hpp"
#include "s3/s3_store.hpp"
#include "store.hpp"

namespace ferry {

// A root or path in an object store (s3://...), rather than a directory.
bool is_object_root(const std::string& path);

// The S3 store's settings from Ferry's options (s3-endpoint, s3-region,
// s3-addressing, s3-parts-in-flight) and the AWS_* credential variables;
// parts are a multiple of the pool's block (chunk-bytes) of at least 8 MiB.
S3StoreOptions s3_store_options(const Options& o);

// A Filesystem over `store`: paths are store->root() + "/" + key.
std::shared_ptr<Filesystem> store_filesystem(std::shared_ptr<Store> store);

// The unfinished uploads under `path` (an object root), and aborting one:
// what gc needs beyond the Filesystem. Empty when `fs` is no object-root
// filesystem of with_object_roots (a wrapper hides it; a directory has none).
Result<std::vector<PendingUpload>> unfinished_uploads(Filesystem& fs, const std::string& path);
Status abort_unfinished_upload(Filesystem& fs, const std::string& path, const PendingUpload& u);

// Paths "s3://bucket/..." go to that bucket's store (made on first use with
// `s3_options()`), every other path to `base`.
std::shared_ptr<Filesystem> with_object_roots(std::shared_ptr<Filesystem> base,
                                              std::function<S3StoreOptions()> s3_options);

}  // namespace ferry
