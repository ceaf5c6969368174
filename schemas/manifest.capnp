# The index of one committed checkpoint: the payload of the MANIFEST file.
# The frame around it (magic, version, required features, payload length and
# checksum) is described in docs/format.md. Never remove or renumber a field:
# retire it by renaming it obsoleteX.
@0x9ab980274a6e4ac3;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("ferry::proto");

struct Manifest {
  formatVersion @0 :UInt32;        # equals the frame's version
  step @1 :UInt64;                 # the training step the caller saved
  commitSeq @2 :UInt64;            # orders commits in one root; highest is latest
  worldSize @3 :Int32;             # ranks that wrote the checkpoint
  jobId @4 :Text;                  # the job that wrote it
  checkpointId @5 :Text;           # unique id of this save
  fsynced @6 :Bool;                # data, manifest and directories were fsynced
  checksumBlockBytes @7 :UInt64;   # size of the blocks each checksum covers
  createdUnixMs @8 :Int64;         # wall clock at commit
  files @9 :List(DataFile);        # data files, referenced by index
  tensors @10 :List(Tensor);       # sorted by key
  metadata @11 :List(KeyValue);    # user key/values given to save_async
  requiredFeatures @12 :List(Text); # copy of the frame's list
}

struct DataFile {
  name @0 :Text;                   # file name inside the checkpoint directory
  size @1 :UInt64;                 # exact size in bytes
  rank @2 :Int32;                  # rank that wrote it
  headerBytes @3 :UInt64;          # safetensors header size incl. the 8-byte length and padding
  headerChecksum @4 :UInt64;       # xxh3-64 of those header bytes
}

struct Tensor {
  key @0 :Text;                    # state dict key
  dtype @1 :Text;                  # safetensors dtype name ("F32", "BF16", ...)
  globalShape @2 :List(Int64);     # shape of the whole tensor
  chunks @3 :List(Chunk);          # disjoint boxes covering the tensor
  perRank @4 :Bool;                # one rank's value of a per-rank entry: key is "<entry>@rank<rank>"
  rank @5 :Int32;                  # that rank (when perRank)
}

struct Chunk {
  offsets @0 :List(Int64);         # box origin in the global tensor
  sizes @1 :List(Int64);           # box extent
  file @2 :UInt32;                 # index into Manifest.files
  byteOffset @3 :UInt64;           # absolute offset of the chunk in the file
  byteLength @4 :UInt64;           # = product(sizes) * dtype size
  entry @5 :Text;                  # safetensors entry name
  checksums @6 :List(UInt64);      # xxh3-64 per checksumBlockBytes piece of the stored bytes; empty if off
  # Compressed chunks (feature "codec-zstd"): byteLength is the stored size.
  codec @7 :Text;                  # "" = raw bytes; "zstd" = zstd frames
  rawLength @8 :UInt64;            # = product(sizes) * dtype size, when compressed
  frameBytes @9 :UInt64;           # raw bytes per frame (the last may be shorter)
  frameEnds @10 :List(UInt64);     # stored end of each frame, from the chunk's start
}

struct KeyValue {
  key @0 :Text;                    # user metadata key
  value @1 :Text;                  # user metadata value
}
