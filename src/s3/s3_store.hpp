// The S3 store: objects under a bucket prefix. Data objects are multipart
// uploads whose parts are the writer's pieces (part_bytes() each, sent as
// they come, parts_in_flight of them at once); small ones are single PUTs. Create-once is
// a conditional PUT (If-None-Match: *), which is why the commit point of a
// checkpoint on S3 is a single-PUT object.
#pragma once

#include <memory>
#include <string>

#include "s3/client.hpp"
#include "store.hpp"

namespace ferry {

struct S3StoreOptions {
  s3::Config client;
  // Each store operation, retries included, ends by this bound; data object
  // writes (parts, complete) and ranged reads by `data_timeout_ms`.
  int64_t op_timeout_ms = 120'000;
  int64_t data_timeout_ms = 120'000;
  // A multiple of the staging pool's block; S3 wants >= 5 MiB but the last.
  uint64_t part_bytes = 8ull << 20;
  // Parts sent at once, by all of the store's writers together; a writer
  // beyond that waits for one to land.
  int parts_in_flight = 8;
};

// `url` is "s3://bucket/prefix"; the bucket must exist.
Result<std::shared_ptr<Store>> s3_store(const std::string& url, const S3StoreOptions& o);

}  // namespace ferry
