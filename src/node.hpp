// Who this process's machine is, for the places that tell nodes apart.
#pragma once

#include <string>

namespace ferry {

// The host name ("?" where it cannot be read), for messages.
std::string host_name();

// "<boot id>:<host name>": two processes are on one node when both agree.
// The boot id tells apart machines (or containers' hosts) that share a
// name; the name tells apart network namespaces that share a boot. The
// transport's lanes and a load's read-once sharing both decide by this, so
// shared memory is never offered where a ring could not be mapped.
std::string node_identity();

}  // namespace ferry
