#include "checksum.hpp"

#include <xxhash.h>

namespace ferry {

uint64_t xxh3_64(const void* data, size_t len) {
  return XXH3_64bits(data, len);
}

StreamingChecksum::StreamingChecksum() : state_(XXH3_createState()) {
  reset();
}
StreamingChecksum::~StreamingChecksum() {
  XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}
void StreamingChecksum::reset() {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
void StreamingChecksum::update(const void* data, size_t len) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, len);
}
uint64_t StreamingChecksum::digest() const {
  return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_));
}

}  // namespace ferry
