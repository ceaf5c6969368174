// Wire encoding of the messages between ranks (schemas/control.capnp,
// schemas/plan.capnp) behind a 16-byte frame. The decoder is the boundary
// where bytes from another process (or from anyone who can reach the port)
// become trusted C++ values, so it checks everything the rest of Ferry would
// otherwise index with: it never throws and never returns a value whose boxes,
// dtypes, status codes or file indices are out of range.

#include "protocol.hpp"
#include "capnp_text.hpp"
#include "copy_bytes.hpp"
#include "frame_buffers.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/array.h>
#include <kj/exception.h>

#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <type_traits>

#include "control.capnp.h"
#include "plan.capnp.h"

namespace ferry {
namespace {

using capnp_util::fill;
using capnp_util::i64s;
using capnp_util::str;
using capnp_util::text;

constexpr char kMagic[4] = {'F', 'R', 'Y', '1'};
constexpr size_t kHeaderBytes = 16;
constexpr uint8_t kControlProtocol = 0;
constexpr uint8_t kPlanProtocol = 1;

// The decode limits scale with the payload (bounded_options): one rank's
// plan or write result in a 4,096-rank job can exceed Cap'n Proto's 64 MiB
// default.

// ferry::StatusCode and proto::Status::Code are converted by value.
using WireCode = proto::Status::Code;
static_assert(static_cast<int>(WireCode::OK) == static_cast<int>(StatusCode::ok));
static_assert(static_cast<int>(WireCode::INVALID_ARGUMENT) ==
              static_cast<int>(StatusCode::invalid_argument));
static_assert(static_cast<int>(WireCode::NOT_FOUND) == static_cast<int>(StatusCode::not_found));
static_assert(static_cast<int>(WireCode::ALREADY_EXISTS) ==
              static_cast<int>(StatusCode::already_exists));
static_assert(static_cast<int>(WireCode::IO_ERROR) == static_cast<int>(StatusCode::io_error));
static_assert(static_cast<int>(WireCode::CORRUPTION) == static_cast<int>(StatusCode::corruption));
static_assert(static_cast<int>(WireCode::UNSUPPORTED) == static_cast<int>(StatusCode::unsupported));
static_assert(static_cast<int>(WireCode::BUSY) == static_cast<int>(StatusCode::busy));
static_assert(static_cast<int>(WireCode::ABORTED) == static_cast<int>(StatusCode::aborted));
static_assert(static_cast<int>(WireCode::TIMEOUT) == static_cast<int>(StatusCode::timeout));
static_assert(static_cast<int>(WireCode::OUTCOME_UNKNOWN) ==
              static_cast<int>(StatusCode::outcome_unknown));
static_assert(static_cast<int>(WireCode::INTERNAL) == static_cast<int>(StatusCode::internal));

// --- encoding ---------------------------------------------------------------------

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void set_status(proto::Status::Builder b, const Status& s) {
  b.setCode(static_cast<WireCode>(s.code()));
  b.setMessage(text(s.message()));
}

// Nothing is set for an empty trace (tracing off): the field stays a null pointer.
void set_trace(proto::RankTrace::Builder b, const RankTrace& t) {
  b.setHost(text(t.host));
  b.setClockErrorNs(t.clock_error_ns);
  auto spans = b.initSpans(static_cast<unsigned>(t.spans.size()));
  for (unsigned i = 0; i < spans.size(); ++i) {
    const TraceSpan& sp = t.spans[i];
    spans[i].setName(text(sp.name));
    spans[i].setTrack(text(sp.track));
    spans[i].setStartNs(sp.start_ns);
    spans[i].setEndNs(sp.end_ns);
    spans[i].setBytes(sp.bytes);
    spans[i].setBusyMs(sp.busy_ms);
  }
}

void set_box(proto::Box::Builder b, const Box& box) {
  fill(b.initOffsets(static_cast<unsigned>(box.offsets.size())), box.offsets);
  fill(b.initSizes(static_cast<unsigned>(box.sizes.size())), box.sizes);
}

// Appends what writeMessage writes, so the message is copied once on its
// way into the frame. A gathered BlockShare's data segment references the
// first of its parts as a stand-in for the whole (capnp only passes the
// segment on): the parts are appended in its place.
class AppendTo final : public kj::OutputStream {
 public:
  explicit AppendTo(std::string& out, const std::vector<std::string_view>* parts = nullptr)
      : out_(out), parts_(parts) {}
  void write(const void* buffer, size_t size) override {
    if (parts_ != nullptr && !parts_->empty() && buffer == parts_->front().data()) {
      for (std::string_view p : *parts_) out_.append(p);
      return;
    }
    out_.append(static_cast<const char*>(buffer), size);
  }

 private:
  std::string& out_;
  const std::vector<std::string_view>* parts_;
};

std::string frame(uint8_t protocol, capnp::MessageBuilder& builder,
                  const std::vector<std::string_view>* parts, FrameBuffers* buffers) {
  const size_t bytes = capnp::computeSerializedSizeInWords(builder) * sizeof(capnp::word);
  std::string out;
  if (buffers != nullptr)
    out = buffers->take_empty(kHeaderBytes + bytes);
  else
    out.reserve(kHeaderBytes + bytes);
  out.append(kMagic, sizeof(kMagic));
  out.push_back(static_cast<char>(protocol));
  out.append(3, '\0');
  put_u64(out, bytes);
  AppendTo sink(out, parts);
  capnp::writeMessage(sink, builder);
  return out;
}

bool whole_words(const char* p, size_t n) {
  return n > 0 && reinterpret_cast<uintptr_t>(p) % sizeof(capnp::word) == 0 &&
         n % sizeof(capnp::word) == 0;
}

// A BlockShare frame whose data is `parts` one after another (m.data itself
// is not sent). Data of whole words becomes a segment of its own, written
// straight into the frame (from the parts, which lie in order in one buffer,
// so the first and the bytes after it are a readable stand-in); other data
// (an odd tail) is copied into the message first.
std::string block_share_frame(const BlockShareMsg& m, const std::vector<std::string_view>& parts,
                              FrameBuffers* buffers) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<proto::ControlMessage>().initBlockShare();
  b.setJobId(text(m.job_id));
  b.setLoadId(text(m.load_id));
  b.setFrom(m.from);
  b.setTo(m.to);
  b.setFile(m.file);
  b.setOffset(m.offset);
  b.setChecksum(m.checksum);
  b.setRingOffset(m.ring_offset);
  b.setRingLength(m.ring_length);
  set_status(b.initStatus(), m.status);
  size_t n = 0;
  for (std::string_view p : parts) n += p.size();
  const char* first = parts.empty() ? nullptr : parts.front().data();
  // (Never an empty segment: readers refuse one.)
  if (whole_words(first, n)) {
    const auto stand_in = kj::arrayPtr(reinterpret_cast<const kj::byte*>(first), n);
    b.adoptData(mb.getOrphanage().referenceExternalData(capnp::Data::Reader(stand_in)));
    return frame(kControlProtocol, mb, &parts, buffers);
  }
  auto data = b.initData(static_cast<unsigned>(n));
  size_t at = 0;
  for (std::string_view p : parts) {
    if (p.empty()) continue;
    copy_bytes(data.begin() + at, p.data(), p.size());
    at += p.size();
  }
  return frame(kControlProtocol, mb, nullptr, buffers);
}

struct Encoder {
  FrameBuffers* buffers;  // where frames take their memory (null: fresh)
  // The overloads below call these, which frame into `buffers`.
  std::string frame(uint8_t protocol, capnp::MessageBuilder& mb) const {
    return ferry::frame(protocol, mb, nullptr, buffers);
  }
  std::string block_share_frame(const BlockShareMsg& m,
                                const std::vector<std::string_view>& parts) const {
    return ferry::block_share_frame(m, parts, buffers);
  }
  std::string operator()(const JoinMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::ControlMessage>().initJoin();
    b.setJobId(text(m.job_id));
    b.setToken(text(m.token));
    b.setRank(m.rank);
    b.setWorldSize(m.world_size);
    b.setHost(text(m.host));
    b.setPid(m.pid);
    return frame(kControlProtocol, mb);
  }

  std::string operator()(const JoinAckMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::ControlMessage>().initJoinAck();
    b.setJobId(text(m.job_id));
    set_status(b.initStatus(), m.status);
    b.setAllJoined(m.all_joined);
    b.setClockNs(m.clock_ns);
    return frame(kControlProtocol, mb);
  }

  std::string operator()(const HeartbeatMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::ControlMessage>().initHeartbeat();
    b.setJobId(text(m.job_id));
    b.setRank(m.rank);
    b.setSeq(m.seq);
    b.setLeaving(m.leaving);
    return frame(kControlProtocol, mb);
  }

  std::string operator()(const AbortMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::ControlMessage>().initAbort();
    b.setJobId(text(m.job_id));
    b.setCheckpointId(text(m.checkpoint_id));
    b.setFailedRank(m.failed_rank);
    b.setPhase(text(m.phase));
    set_status(b.initReason(), m.reason);
    return frame(kControlProtocol, mb);
  }

  std::string operator()(const CommitMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::ControlMessage>().initCommit();
    b.setJobId(text(m.job_id));
    b.setCheckpointId(text(m.checkpoint_id));
    set_status(b.initStatus(), m.status);
    b.setPath(text(m.path));
    b.setCommitSeq(m.commit_seq);
    b.setSlowestRank(m.slowest_rank);
    b.setSlowestMs(m.slowest_ms);
    auto warnings = b.initWarnings(static_cast<unsigned>(m.warnings.size()));
    for (unsigned i = 0; i < m.warnings.size(); ++i) warnings.set(i, text(m.warnings[i]));
    return frame(kControlProtocol, mb);
  }

  std::string operator()(const PlanRequest& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::PlanMessage>().initPlanRequest();
    b.setJobId(text(m.job_id));
    b.setCheckpointId(text(m.checkpoint_id));
    b.setRank(m.rank);
    b.setStep(m.step);
    b.setRoot(text(m.root));
    b.setOverwrite(m.overwrite);
    auto meta = b.initMetadata(static_cast<unsigned>(m.metadata.size()));
    for (unsigned i = 0; i < meta.size(); ++i) {
      meta[i].setKey(text(m.metadata[i].first));
      meta[i].setValue(text(m.metadata[i].second));
    }
    auto plan = b.initPlan();
    plan.setRank(plan_of(m).rank);
    auto items = plan.initItems(static_cast<unsigned>(plan_of(m).items.size()));
    for (unsigned i = 0; i < items.size(); ++i) {
      const WriteItem& w = plan_of(m).items[i];
      auto it = items[i];
      it.setKey(text(w.key));
      it.setDtype(dtype_name(w.dtype));
      fill(it.initGlobalShape(static_cast<unsigned>(w.global_shape.size())), w.global_shape);
      set_box(it.initBox(), w.box);
      it.setNbytes(w.nbytes);
      it.setEntry(w.entry);
    }
    b.setWantAll(m.want_all);
    b.setOwnerPolicy(m.owner_policy);
    b.setFilePrefix(text(m.files.prefix));
    b.setFileMaxBytes(m.files.max_bytes);
    b.setFileCompress(text(m.files.compress));
    return frame(kPlanProtocol, mb);
  }

  std::string operator()(const PlanReply& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::PlanMessage>().initPlanReply();
    b.setJobId(text(m.job_id));
    b.setCheckpointId(text(m.checkpoint_id));
    set_status(b.initStatus(), m.status);
    b.setPendingDir(text(m.pending_dir));
    if (!m.all_plans.empty())
      b.setAllPlans(
          kj::arrayPtr(reinterpret_cast<const kj::byte*>(m.all_plans.data()), m.all_plans.size()));
    auto plan = b.initPlan();
    plan.setRank(m.plan.rank);
    plan.setFiles(m.plan.files);
    plan.setBytes(m.plan.bytes);
    auto chunks = plan.initChunks(static_cast<unsigned>(m.plan.chunks.size()));
    for (unsigned i = 0; i < chunks.size(); ++i) {
      const ChunkAssignment& c = m.plan.chunks[i];
      auto cb = chunks[i];
      cb.setItem(c.item);
      // A whole chunk's box is its item's, which the receiving rank has: most
      // chunks are whole, so leaving the box unset keeps plans small.
      if (c.whole)
        cb.setWhole(true);
      else
        set_box(cb.initBox(), c.box);
      cb.setFile(c.file);
    }
    auto replicated = plan.initReplicated(static_cast<unsigned>(m.plan.replicated.size()));
    for (unsigned i = 0; i < replicated.size(); ++i) replicated.set(i, m.plan.replicated[i]);
    return frame(kPlanProtocol, mb);
  }

  std::string operator()(const CommitRequest& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::PlanMessage>().initCommitRequest();
    b.setJobId(text(m.job_id));
    b.setCheckpointId(text(m.checkpoint_id));
    const WriteResult& r = m.result;
    auto rb = b.initResult();
    rb.setRank(r.rank);
    rb.setSnapshotMs(r.snapshot_ms);
    rb.setWriteMs(r.write_ms);
    rb.setBytes(r.bytes);
    rb.setReadyMs(r.ready_ms);
    auto files = rb.initFiles(static_cast<unsigned>(r.files.size()));
    for (unsigned i = 0; i < files.size(); ++i) {
      files[i].setName(text(r.files[i].name));
      files[i].setSize(r.files[i].size);
      files[i].setHeaderBytes(r.files[i].header_bytes);
      files[i].setHeaderChecksum(r.files[i].header_checksum);
    }
    auto chunks = rb.initChunks(static_cast<unsigned>(r.chunks.size()));
    for (unsigned i = 0; i < chunks.size(); ++i) {
      const WrittenChunk& c = r.chunks[i];
      auto cb = chunks[i];
      cb.setKey(text(c.key));
      cb.setDtype(dtype_name(c.dtype));
      fill(cb.initGlobalShape(static_cast<unsigned>(c.global_shape.size())), c.global_shape);
      set_box(cb.initBox(), c.box);
      capnp_util::set_stored_bytes(cb, c);
    }
    auto digests = rb.initReplicaDigests(static_cast<unsigned>(r.replica_digests.size()));
    for (unsigned i = 0; i < digests.size(); ++i) {
      const ReplicaDigest& d = r.replica_digests[i];
      digests[i].setKey(text(d.key));
      fill(digests[i].initOffsets(static_cast<unsigned>(d.offsets.size())), d.offsets);
      digests[i].setDigest(d.digest);
      digests[i].setSampled(d.sampled);
    }
    if (!m.trace.empty()) set_trace(b.initTrace(), m.trace);
    return frame(kPlanProtocol, mb);
  }

  std::string operator()(const LoadRequestMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::PlanMessage>().initLoadRequest();
    b.setJobId(text(m.job_id));
    b.setLoadId(text(m.load_id));
    b.setRank(m.rank);
    b.setPath(text(m.path));
    return frame(kPlanProtocol, mb);
  }

  std::string operator()(const LoadReplyMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::PlanMessage>().initLoadReply();
    b.setJobId(text(m.job_id));
    b.setLoadId(text(m.load_id));
    set_status(b.initStatus(), m.status);
    b.setDir(text(m.dir));
    b.setManifest(
        kj::arrayPtr(reinterpret_cast<const kj::byte*>(m.manifest.data()), m.manifest.size()));
    return frame(kPlanProtocol, mb);
  }

  std::string operator()(const LoadOutcomeMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::ControlMessage>().initLoadOutcome();
    b.setJobId(text(m.job_id));
    b.setLoadId(text(m.load_id));
    b.setRank(m.rank);
    set_status(b.initStatus(), m.status);
    b.setFailedRank(m.failed_rank);
    if (!m.needs.empty()) {
      auto needs = b.initNeeds(static_cast<unsigned>(m.needs.size()));
      for (unsigned i = 0; i < m.needs.size(); ++i) {
        const RankNeeds& n = m.needs[i];
        auto nb = needs[i];
        nb.setRank(n.rank);
        nb.setHost(text(n.host));
        auto rs = nb.initRanges(static_cast<unsigned>(n.ranges.size()));
        for (unsigned j = 0; j < n.ranges.size(); ++j) {
          const NeededRange& nr = n.ranges[j];
          rs[j].setFile(nr.range.file);
          rs[j].setOffset(nr.range.offset);
          rs[j].setLength(nr.range.length);
          fill(rs[j].initRegionOffsets(static_cast<unsigned>(nr.region.offsets.size())),
               nr.region.offsets);
          fill(rs[j].initRegionSizes(static_cast<unsigned>(nr.region.sizes.size())),
               nr.region.sizes);
        }
        nb.setRingPid(n.ring.pid);
        nb.setRingFd(n.ring.fd);
        nb.setRingBytes(n.ring.bytes);
        nb.setRingToken(n.ring.token);
      }
    }
    if (!m.trace.empty()) set_trace(b.initTrace(), m.trace);
    return frame(kControlProtocol, mb);
  }

  std::string operator()(const BlockShareMsg& m) const {
    return block_share_frame(m, {m.data.view()});
  }

  std::string operator()(const ShareAckMsg& m) const {
    capnp::MallocMessageBuilder mb;
    auto b = mb.initRoot<proto::ControlMessage>().initShareAck();
    b.setJobId(text(m.job_id));
    b.setLoadId(text(m.load_id));
    b.setFrom(m.from);
    b.setTo(m.to);
    b.setBytes(m.bytes);
    set_status(b.initStatus(), m.status);
    return frame(kControlProtocol, mb);
  }
};

// --- decoding ---------------------------------------------------------------------
//
// The readers below may throw kj::Exception on a malformed payload (bad
// pointers, traversal or nesting limits); decode_message catches it. What
// Cap'n Proto accepts but Ferry cannot use comes back as a Status naming the
// field.

std::string quoted(const std::string& s) {
  return "\"" + s + "\"";
}

// Offsets and sizes apart: on hostile input their ranks may differ.
std::string box_text(const Box& b) {
  return "box (offsets " + shape_to_string(b.offsets) + ", sizes " + shape_to_string(b.sizes) + ")";
}

Status read_status(proto::Status::Reader r, const std::string& where, Status* out) {
  const auto raw = static_cast<uint16_t>(r.getCode());
  if (raw > static_cast<uint16_t>(StatusCode::internal))
    return Status::invalid_argument(where + ": unknown status code " + std::to_string(raw));
  *out = Status(static_cast<StatusCode>(raw), str(r.getMessage()));
  return Status();
}

Status read_rank(int32_t rank, const std::string& where) {
  if (rank < 0) return Status::invalid_argument(where + ": negative rank " + std::to_string(rank));
  return Status();
}

Status read_dtype(capnp::Text::Reader t, const std::string& where, DType* out) {
  Result<DType> d = parse_dtype(str(t));
  if (!d.ok()) return d.status().with_context(where + ": ");
  *out = *d;
  return Status();
}

// A box's offsets and sizes, each non-negative.
Status read_box(capnp::List<int64_t>::Reader offsets, capnp::List<int64_t>::Reader sizes,
                const std::string& where, Box* out) {
  out->offsets = i64s(offsets);
  out->sizes = i64s(sizes);
  if (out->offsets.size() != out->sizes.size())
    return Status::invalid_argument(where + ": box has " + std::to_string(out->offsets.size()) +
                                    " offsets but " + std::to_string(out->sizes.size()) + " sizes");
  for (size_t d = 0; d < out->sizes.size(); ++d)
    if (out->offsets[d] < 0 || out->sizes[d] < 0)
      return Status::invalid_argument(where + ": negative offset or size in box dim " +
                                      std::to_string(d));
  return Status();
}

Status read_box(proto::Box::Reader r, const std::string& where, Box* out) {
  return read_box(r.getOffsets(), r.getSizes(), where, out);
}

// A box that lies inside its tensor, and a tensor whose byte size fits in
// int64, so that later arithmetic on either cannot overflow.
Status check_in_shape(const Box& box, const std::vector<int64_t>& shape, DType dtype,
                      const std::string& where) {
  if (box.rank() != shape.size())
    return Status::invalid_argument(where + ": " + box_text(box) + " has rank " +
                                    std::to_string(box.rank()) + ", the global shape " +
                                    std::to_string(shape.size()));
  int64_t bytes = static_cast<int64_t>(dtype_size(dtype));
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0)
      return Status::invalid_argument(where + ": negative global shape in dim " +
                                      std::to_string(d));
    if (__builtin_mul_overflow(bytes, shape[d], &bytes))
      return Status::invalid_argument(where + ": global shape too large");
    if (box.offsets[d] > shape[d] - box.sizes[d])
      return Status::invalid_argument(where + ": " + box_text(box) +
                                      " exceeds the global shape in dim " + std::to_string(d));
  }
  return Status();
}

// `frame` holds the bytes `root` reads, or is null where they are a copy
// that ends with the decode: a BlockShare's data then views the frame, or
// is copied out.
// A rank's timeline as it sent it; spans that end before they start are refused.
Status read_trace(proto::RankTrace::Reader r, int32_t rank, const std::string& where,
                  RankTrace* out) {
  out->rank = rank;
  out->host = str(r.getHost());
  out->clock_error_ns = r.getClockErrorNs();
  for (auto sp : r.getSpans()) {
    TraceSpan t{str(sp.getName()), str(sp.getTrack()), sp.getStartNs(),
                sp.getEndNs(),     sp.getBytes(),      sp.getBusyMs()};
    if (t.end_ns < t.start_ns)
      return Status::invalid_argument(where + " trace of rank " + std::to_string(rank) +
                                      ": span '" + t.name + "' ends before it starts");
    out->spans.push_back(std::move(t));
  }
  return Status();
}

Result<WireMessage> read_control(proto::ControlMessage::Reader root,
                                 const std::shared_ptr<const std::string>& frame) {
  switch (root.which()) {
    case proto::ControlMessage::JOIN: {
      auto r = root.getJoin();
      JoinMsg m;
      m.job_id = str(r.getJobId());
      m.token = str(r.getToken());
      m.rank = r.getRank();
      m.world_size = r.getWorldSize();
      m.host = str(r.getHost());
      m.pid = r.getPid();
      if (m.world_size < 1 || m.rank < 0 || m.rank >= m.world_size)
        return Status::invalid_argument("Join: rank " + std::to_string(m.rank) +
                                        " outside world size " + std::to_string(m.world_size));
      return WireMessage(std::move(m));
    }
    case proto::ControlMessage::JOIN_ACK: {
      auto r = root.getJoinAck();
      JoinAckMsg m;
      m.job_id = str(r.getJobId());
      FERRY_RETURN_IF_ERROR(read_status(r.getStatus(), "JoinAck status", &m.status));
      m.all_joined = r.getAllJoined();
      m.clock_ns = r.getClockNs();
      return WireMessage(std::move(m));
    }
    case proto::ControlMessage::HEARTBEAT: {
      auto r = root.getHeartbeat();
      HeartbeatMsg m;
      m.job_id = str(r.getJobId());
      m.rank = r.getRank();
      m.seq = r.getSeq();
      m.leaving = r.getLeaving();
      FERRY_RETURN_IF_ERROR(read_rank(m.rank, "Heartbeat"));
      return WireMessage(std::move(m));
    }
    case proto::ControlMessage::ABORT: {
      auto r = root.getAbort();
      AbortMsg m;
      m.job_id = str(r.getJobId());
      m.checkpoint_id = str(r.getCheckpointId());
      m.failed_rank = r.getFailedRank();
      m.phase = str(r.getPhase());
      if (m.failed_rank < -1)
        return Status::invalid_argument("Abort: failed rank " + std::to_string(m.failed_rank));
      FERRY_RETURN_IF_ERROR(read_status(r.getReason(), "Abort reason", &m.reason));
      return WireMessage(std::move(m));
    }
    case proto::ControlMessage::COMMIT: {
      auto r = root.getCommit();
      CommitMsg m;
      m.job_id = str(r.getJobId());
      m.checkpoint_id = str(r.getCheckpointId());
      FERRY_RETURN_IF_ERROR(read_status(r.getStatus(), "Commit status", &m.status));
      m.path = str(r.getPath());
      m.commit_seq = r.getCommitSeq();
      m.slowest_rank = r.getSlowestRank();
      m.slowest_ms = r.getSlowestMs();
      for (auto w : r.getWarnings()) m.warnings.push_back(str(w));
      return WireMessage(std::move(m));
    }
    case proto::ControlMessage::LOAD_OUTCOME: {
      auto r = root.getLoadOutcome();
      LoadOutcomeMsg m;
      m.job_id = str(r.getJobId());
      m.load_id = str(r.getLoadId());
      m.rank = r.getRank();
      m.failed_rank = r.getFailedRank();
      FERRY_RETURN_IF_ERROR(read_rank(m.rank, "LoadOutcome"));
      if (m.failed_rank < -1)
        return Status::invalid_argument("LoadOutcome: failed rank " +
                                        std::to_string(m.failed_rank));
      FERRY_RETURN_IF_ERROR(read_status(r.getStatus(), "LoadOutcome status", &m.status));
      for (auto n : r.getNeeds()) {
        RankNeeds rn;
        rn.rank = n.getRank();
        FERRY_RETURN_IF_ERROR(read_rank(rn.rank, "LoadOutcome needs"));
        rn.host = str(n.getHost());
        rn.ring = RingInfo{n.getRingPid(), n.getRingFd(), n.getRingBytes(), n.getRingToken()};
        for (auto fr : n.getRanges()) {
          NeededRange nr{FileRange{fr.getFile(), fr.getOffset(), fr.getLength()}, Box{}};
          if (nr.range.offset + nr.range.length < nr.range.offset)
            return Status::invalid_argument("LoadOutcome needs of rank " + std::to_string(rn.rank) +
                                            ": range overflows");
          FERRY_RETURN_IF_ERROR(read_box(fr.getRegionOffsets(), fr.getRegionSizes(),
                                         "LoadOutcome needs of rank " + std::to_string(rn.rank),
                                         &nr.region));
          // Box arithmetic on it (bounding boxes, intersections) cannot overflow.
          for (size_t d = 0; d < nr.region.rank(); ++d)
            if (nr.region.offsets[d] > std::numeric_limits<int64_t>::max() - nr.region.sizes[d])
              return Status::invalid_argument("LoadOutcome needs of rank " +
                                              std::to_string(rn.rank) + ": region dim " +
                                              std::to_string(d) + " overflows");
          rn.ranges.push_back(nr);
        }
        m.needs.push_back(std::move(rn));
      }
      if (r.hasTrace())
        FERRY_RETURN_IF_ERROR(read_trace(r.getTrace(), m.rank, "LoadOutcome", &m.trace));
      return WireMessage(std::move(m));
    }
    case proto::ControlMessage::BLOCK_SHARE: {
      auto r = root.getBlockShare();
      BlockShareMsg m;
      m.job_id = str(r.getJobId());
      m.load_id = str(r.getLoadId());
      m.from = r.getFrom();
      m.to = r.getTo();
      FERRY_RETURN_IF_ERROR(read_rank(m.from, "BlockShare sender"));
      FERRY_RETURN_IF_ERROR(read_rank(m.to, "BlockShare receiver"));
      m.file = r.getFile();
      m.offset = r.getOffset();
      m.checksum = r.getChecksum();
      FERRY_RETURN_IF_ERROR(read_status(r.getStatus(), "BlockShare status", &m.status));
      auto d = r.getData();
      m.ring_offset = r.getRingOffset();
      m.ring_length = r.getRingLength();
      if (m.ring_length > 0 && d.size() > 0)
        return Status::invalid_argument("BlockShare: data both in the frame and in the ring");
      const uint64_t n = m.ring_length > 0 ? m.ring_length : d.size();
      if (m.offset + n < m.offset || m.ring_offset + m.ring_length < m.ring_offset)
        return Status::invalid_argument("BlockShare: offset plus data length overflows");
      const std::string_view bytes(reinterpret_cast<const char*>(d.begin()), d.size());
      m.data = frame ? SharedBytes(frame, bytes) : SharedBytes(std::string(bytes));
      return WireMessage(std::move(m));
    }
    case proto::ControlMessage::SHARE_ACK: {
      auto r = root.getShareAck();
      ShareAckMsg m;
      m.job_id = str(r.getJobId());
      m.load_id = str(r.getLoadId());
      m.from = r.getFrom();
      m.to = r.getTo();
      FERRY_RETURN_IF_ERROR(read_rank(m.from, "ShareAck receiver"));
      FERRY_RETURN_IF_ERROR(read_rank(m.to, "ShareAck sender"));
      m.bytes = r.getBytes();
      FERRY_RETURN_IF_ERROR(read_status(r.getStatus(), "ShareAck status", &m.status));
      return WireMessage(std::move(m));
    }
  }
  return Status::invalid_argument("unknown ControlMessage member " +
                                  std::to_string(static_cast<uint16_t>(root.which())) +
                                  " (sent by a newer Ferry?)");
}

Result<WireMessage> read_plan_request(proto::PlanRequest::Reader r) {
  PlanRequest m;
  m.job_id = str(r.getJobId());
  m.checkpoint_id = str(r.getCheckpointId());
  m.rank = r.getRank();
  m.step = r.getStep();
  m.root = str(r.getRoot());
  m.overwrite = r.getOverwrite();
  FERRY_RETURN_IF_ERROR(read_rank(m.rank, "PlanRequest"));
  auto meta = r.getMetadata();
  m.metadata.reserve(meta.size());
  for (auto kv : meta) m.metadata.emplace_back(str(kv.getKey()), str(kv.getValue()));
  auto plan = r.getPlan();
  m.plan.rank = plan.getRank();
  FERRY_RETURN_IF_ERROR(read_rank(m.plan.rank, "PlanRequest plan"));
  auto items = plan.getItems();
  m.plan.items.resize(items.size());
  for (unsigned i = 0; i < items.size(); ++i) {
    auto it = items[i];
    WriteItem& w = m.plan.items[i];
    w.key = str(it.getKey());
    const std::string where = "PlanRequest item " + std::to_string(i) + " " + quoted(w.key);
    FERRY_RETURN_IF_ERROR(read_dtype(it.getDtype(), where, &w.dtype));
    w.global_shape = i64s(it.getGlobalShape());
    FERRY_RETURN_IF_ERROR(read_box(it.getBox(), where, &w.box));
    FERRY_RETURN_IF_ERROR(check_in_shape(w.box, w.global_shape, w.dtype, where));
    w.nbytes = it.getNbytes();
    w.entry = it.getEntry();
  }
  m.want_all = r.getWantAll();
  m.owner_policy = r.getOwnerPolicy();
  if (m.owner_policy > 2)
    return Status::invalid_argument("PlanRequest owner policy " + std::to_string(m.owner_policy) +
                                    " is not 0, 1 or 2");
  m.files.prefix = str(r.getFilePrefix());
  m.files.max_bytes = r.getFileMaxBytes();
  m.files.compress = str(r.getFileCompress());
  FERRY_RETURN_IF_ERROR(check_data_files(m.files, "PlanRequest"));
  return WireMessage(std::move(m));
}

Result<WireMessage> read_plan_reply(proto::PlanReply::Reader r) {
  PlanReply m;
  m.job_id = str(r.getJobId());
  m.checkpoint_id = str(r.getCheckpointId());
  FERRY_RETURN_IF_ERROR(read_status(r.getStatus(), "PlanReply status", &m.status));
  m.pending_dir = str(r.getPendingDir());
  if (r.hasAllPlans()) {
    auto all = r.getAllPlans();
    m.all_plans.assign(reinterpret_cast<const char*>(all.begin()), all.size());
  }
  auto plan = r.getPlan();
  m.plan.rank = plan.getRank();
  m.plan.files = plan.getFiles();
  m.plan.bytes = plan.getBytes();
  FERRY_RETURN_IF_ERROR(read_rank(m.plan.rank, "PlanReply plan"));
  auto chunks = plan.getChunks();
  m.plan.chunks.resize(chunks.size());
  for (unsigned i = 0; i < chunks.size(); ++i) {
    auto c = chunks[i];
    ChunkAssignment& a = m.plan.chunks[i];
    const std::string where = "PlanReply chunk " + std::to_string(i);
    a.item = c.getItem();
    a.file = c.getFile();
    a.whole = c.getWhole();
    if (!a.whole) {
      FERRY_RETURN_IF_ERROR(read_box(c.getBox(), where, &a.box));
    } else if (c.hasBox()) {
      // Tolerated only empty: a box next to `whole` would say two things.
      auto b = c.getBox();
      if (b.getOffsets().size() != 0 || b.getSizes().size() != 0)
        return Status::invalid_argument(where + ": a whole chunk with a box of its own");
    }
    if (a.file >= m.plan.files)
      return Status::invalid_argument(where + ": file " + std::to_string(a.file) +
                                      " but the rank writes " + std::to_string(m.plan.files) +
                                      " files");
  }
  auto replicated = plan.getReplicated();
  m.plan.replicated.reserve(replicated.size());
  for (uint32_t i : replicated) m.plan.replicated.push_back(i);
  return WireMessage(std::move(m));
}

Result<WireMessage> read_commit_request(proto::CommitRequest::Reader r) {
  CommitRequest m;
  m.job_id = str(r.getJobId());
  m.checkpoint_id = str(r.getCheckpointId());
  auto res = r.getResult();
  WriteResult& w = m.result;
  w.rank = res.getRank();
  w.snapshot_ms = res.getSnapshotMs();
  w.write_ms = res.getWriteMs();
  w.bytes = res.getBytes();
  w.ready_ms = res.getReadyMs();
  FERRY_RETURN_IF_ERROR(read_rank(w.rank, "CommitRequest result"));
  auto files = res.getFiles();
  w.files.resize(files.size());
  for (unsigned i = 0; i < files.size(); ++i) {
    auto f = files[i];
    w.files[i].name = str(f.getName());
    w.files[i].size = f.getSize();
    w.files[i].header_bytes = f.getHeaderBytes();
    w.files[i].header_checksum = f.getHeaderChecksum();
    if (w.files[i].header_bytes > w.files[i].size)
      return Status::invalid_argument("CommitRequest result: file '" + w.files[i].name +
                                      "' has a " + std::to_string(w.files[i].header_bytes) +
                                      "-byte header in " + std::to_string(w.files[i].size) +
                                      " bytes");
  }
  auto chunks = res.getChunks();
  w.chunks.resize(chunks.size());
  for (unsigned i = 0; i < chunks.size(); ++i) {
    auto c = chunks[i];
    WrittenChunk& wc = w.chunks[i];
    wc.key = str(c.getKey());
    const std::string where = "CommitRequest chunk " + std::to_string(i) + " " + quoted(wc.key);
    FERRY_RETURN_IF_ERROR(read_dtype(c.getDtype(), where, &wc.dtype));
    wc.global_shape = i64s(c.getGlobalShape());
    FERRY_RETURN_IF_ERROR(read_box(c.getBox(), where, &wc.box));
    FERRY_RETURN_IF_ERROR(check_in_shape(wc.box, wc.global_shape, wc.dtype, where));
    capnp_util::get_stored_bytes(c, &wc);
    if (wc.file >= w.files.size())
      return Status::invalid_argument(where + ": file " + std::to_string(wc.file) +
                                      " but the rank reports " + std::to_string(w.files.size()) +
                                      " files");
  }
  auto digests = res.getReplicaDigests();
  w.replica_digests.resize(digests.size());
  for (unsigned i = 0; i < digests.size(); ++i) {
    ReplicaDigest& d = w.replica_digests[i];
    d.key = str(digests[i].getKey());
    d.offsets = i64s(digests[i].getOffsets());
    d.digest = digests[i].getDigest();
    d.sampled = digests[i].getSampled();
  }
  if (r.hasTrace())
    FERRY_RETURN_IF_ERROR(read_trace(r.getTrace(), w.rank, "CommitRequest", &m.trace));
  return WireMessage(std::move(m));
}

Result<WireMessage> read_plan(proto::PlanMessage::Reader root) {
  switch (root.which()) {
    case proto::PlanMessage::PLAN_REQUEST:
      return read_plan_request(root.getPlanRequest());
    case proto::PlanMessage::PLAN_REPLY:
      return read_plan_reply(root.getPlanReply());
    case proto::PlanMessage::COMMIT_REQUEST:
      return read_commit_request(root.getCommitRequest());
    case proto::PlanMessage::LOAD_REQUEST: {
      auto r = root.getLoadRequest();
      LoadRequestMsg m;
      m.job_id = str(r.getJobId());
      m.load_id = str(r.getLoadId());
      m.rank = r.getRank();
      m.path = str(r.getPath());
      FERRY_RETURN_IF_ERROR(read_rank(m.rank, "LoadRequest"));
      return WireMessage(std::move(m));
    }
    case proto::PlanMessage::LOAD_REPLY: {
      auto r = root.getLoadReply();
      LoadReplyMsg m;
      m.job_id = str(r.getJobId());
      m.load_id = str(r.getLoadId());
      FERRY_RETURN_IF_ERROR(read_status(r.getStatus(), "LoadReply status", &m.status));
      m.dir = str(r.getDir());
      auto data = r.getManifest();
      m.manifest.assign(reinterpret_cast<const char*>(data.begin()), data.size());
      return WireMessage(std::move(m));
    }
  }
  return Status::invalid_argument("unknown PlanMessage member " +
                                  std::to_string(static_cast<uint16_t>(root.which())) +
                                  " (sent by a newer Ferry?)");
}

uint64_t get_u64_le(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string hex(std::string_view bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 0xf]);
  }
  return out;
}

Result<WireMessage> decode_payload(uint8_t protocol, std::string_view payload,
                                   const std::shared_ptr<const std::string>& frame) {
  // Cap'n Proto reads words in place; UCX hands over frames at any address,
  // a frame of our own (a heap string) is aligned and read where it is.
  kj::Array<capnp::word> copy;
  kj::ArrayPtr<const capnp::word> words;
  const bool in_place =
      frame && reinterpret_cast<uintptr_t>(payload.data()) % sizeof(capnp::word) == 0;
  if (in_place) {
    words = kj::arrayPtr(reinterpret_cast<const capnp::word*>(payload.data()),
                         payload.size() / sizeof(capnp::word));
  } else {
    copy = capnp_util::aligned_words(payload.data(), payload.size());
    words = copy.asPtr();
  }
  capnp::FlatArrayMessageReader reader(words, capnp_util::bounded_options(words.size(), 1024));
  if (reader.getEnd() != words.end())
    return Status::invalid_argument(
        std::to_string((words.end() - reader.getEnd()) * sizeof(capnp::word)) +
        " trailing bytes after the message");
  if (protocol == kControlProtocol)
    return read_control(reader.getRoot<proto::ControlMessage>(), in_place ? frame : nullptr);
  return read_plan(reader.getRoot<proto::PlanMessage>());
}

Result<WireMessage> decode_frame(std::string_view bytes,
                                 const std::shared_ptr<const std::string>& frame) {
  if (bytes.size() < kHeaderBytes)
    return Status::invalid_argument("message frame truncated: " + std::to_string(bytes.size()) +
                                    " bytes, the header alone is " + std::to_string(kHeaderBytes));
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    return Status::invalid_argument("bad message magic: expected \"FRY1\" (46525931), got " +
                                    hex(bytes.substr(0, sizeof(kMagic))));
  const auto protocol = static_cast<uint8_t>(bytes[4]);
  if (protocol != kControlProtocol && protocol != kPlanProtocol)
    return Status::invalid_argument("unknown message protocol byte " + std::to_string(protocol) +
                                    " (0 control, 1 plan)");
  if (bytes[5] != 0 || bytes[6] != 0 || bytes[7] != 0)
    return Status::invalid_argument("reserved message frame bytes are not zero: " +
                                    hex(bytes.substr(5, 3)));
  const uint64_t length = get_u64_le(bytes.data() + 8);
  const uint64_t remaining = bytes.size() - kHeaderBytes;
  if (length != remaining)
    return Status::invalid_argument("message payload length " + std::to_string(length) +
                                    " does not match the " + std::to_string(remaining) +
                                    " bytes after the header");
  if (length == 0 || length % sizeof(capnp::word) != 0)
    return Status::invalid_argument("message payload length " + std::to_string(length) +
                                    " is not a positive multiple of 8");

  const std::string what = protocol == kControlProtocol ? "control" : "plan";
  try {
    Result<WireMessage> out = decode_payload(protocol, bytes.substr(kHeaderBytes), frame);
    if (!out.ok()) return out.status().with_context("malformed " + what + " message: ");
    return out;
  } catch (const kj::Exception& e) {
    return Status::invalid_argument("malformed " + what +
                                    " message: " + std::string(e.getDescription().cStr()));
  } catch (const std::bad_alloc&) {
    return Status::internal("out of memory decoding a " + std::to_string(length) + "-byte " + what +
                            " message");
  } catch (const std::exception& e) {
    return Status::invalid_argument("malformed " + what + " message: " + e.what());
  }
}

template <class T>
constexpr bool kHasCheckpointId =
    std::is_same_v<T, AbortMsg> || std::is_same_v<T, CommitMsg> || std::is_same_v<T, PlanRequest> ||
    std::is_same_v<T, PlanReply> || std::is_same_v<T, CommitRequest>;
template <class T>
constexpr bool kHasLoadId = std::is_same_v<T, LoadRequestMsg> || std::is_same_v<T, LoadReplyMsg> ||
                            std::is_same_v<T, LoadOutcomeMsg> || std::is_same_v<T, BlockShareMsg> ||
                            std::is_same_v<T, ShareAckMsg>;

}  // namespace

std::string_view message_job_id(const WireMessage& m) {
  return std::visit([](const auto& x) -> std::string_view { return x.job_id; }, m);
}

std::string_view message_checkpoint_id(const WireMessage& m) {
  return std::visit(
      [](const auto& x) -> std::string_view {
        using T = std::decay_t<decltype(x)>;
        if constexpr (kHasCheckpointId<T>) {
          return x.checkpoint_id;
        } else if constexpr (kHasLoadId<T>) {
          return x.load_id;
        } else {
          return {};
        }
      },
      m);
}

const char* message_name(const WireMessage& m) {
  static const char* const kNames[] = {"Join",        "JoinAck",     "Heartbeat",   "Abort",
                                       "Commit",      "PlanRequest", "PlanReply",   "CommitRequest",
                                       "LoadRequest", "LoadReply",   "LoadOutcome", "BlockShare",
                                       "ShareAck"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == std::variant_size_v<WireMessage>);
  return kNames[m.index()];
}

std::string encode_message(const WireMessage& m, FrameBuffers* buffers) {
  return std::visit(Encoder{buffers}, m);
}

std::string encode_gathered(const BlockShareMsg& m, const std::vector<std::string_view>& parts,
                            FrameBuffers* buffers) {
  return block_share_frame(m, parts, buffers);
}

Result<WireMessage> decode_message(std::string_view bytes) {
  return decode_frame(bytes, nullptr);
}

Result<WireMessage> decode_message(std::shared_ptr<const std::string> frame) {
  if (!frame) return Status::invalid_argument("no message frame");
  const std::string_view bytes(*frame);
  return decode_frame(bytes, frame);
}

}  // namespace ferry
