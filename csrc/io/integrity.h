// integrity.h — the row checksums of a sidecar (format 3) and the checks the engine runs on the bytes
// it reads before computing with them.
//
// Per served layer the sidecar stores the CRC-32C (crc32c.h) of every row the engine can read:
//   bundle    : n_ff rows of bundle_stride bytes  (sidecar ffn_bundle; padding included)
//   down_t    : n_ff rows of down_t_row_bytes     (sidecar ffn_down_t)
//   base_gate : n_ff rows of gate_row_bytes       (base ffn_gate, base neuron order)
//   base_up   : n_ff rows of up_row_bytes         (base ffn_up, base neuron order)
//   base_down : n_embd rows of base_down_row_bytes (base ffn_down)
// Row granularity fits every cluster size (a cluster is a run of whole rows). Where the tables lie
// (LayerSpec::checksum_offset: uint32 [n_ff][4] in the column order above without base_down;
// LayerSpec::base_down_checksum_offset: uint32 [n_embd]) and the tensor names used in messages come from
// the configuration (Python's sidecar_format is the one place that spells them).
//
// A mismatch throws IntegrityError (an IoError: callers that report read failures report it too)
// naming the file, the tensor, the row, its byte range in the file and the way out.
#pragma once

#include "io/file_reader.h"
#include "model/engine_config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace llamaflash {

class IntegrityError : public IoError {
public:
    using IoError::IoError;
};

// Every integrity message starts with this (Python tells a failed check from a failed read by it).
extern const char * const kIntegrityErrorPrefix;

// One tensor's rows as the check names them: row r lies at file offset `offset + r·row_bytes`.
struct RowSource {
    std::string file;        // path
    std::string tensor;      // tensor name
    uint64_t offset = 0;     // absolute offset of row 0
    uint64_t row_bytes = 0;  // bytes per row (checked bytes = the whole row)
    std::string way_out;     // what the user should do
};

// Checks rows [first, first + n) against expected[first ...]: row first + i starts at data + i·stride
// (stride >= src.row_bytes). Throws IntegrityError at the first mismatch. Returns the bytes checked.
uint64_t verify_rows(const uint8_t * data, size_t stride, int64_t first, int64_t n, const uint32_t * expected,
                     const RowSource & src);

// Checks rows [first, first + n) of `src` by reading them from `file` in chunks of about `chunk_bytes`
// (then, with drop, dropping their page cache: advice). Throws IoError (read) / IntegrityError.
// Returns the bytes checked.
uint64_t verify_file_rows(const FileReader & file, int64_t first, int64_t n, const uint32_t * expected,
                          const RowSource & src, size_t chunk_bytes = size_t{4} << 20, bool drop = true);

// A served layer's expected checksums (empty vectors: the sidecar has none).
struct LayerChecksums {
    std::vector<uint32_t> bundle, down_t, base_gate, base_up;  // n_ff each
    std::vector<uint32_t> base_down;                           // n_embd
    bool present() const { return !bundle.empty(); }
};

// Which of a layer's row sets a RowSource describes.
enum class RowSet : int {
    bundle = 0,
    down_t = 1,
    base_gate = 2,
    base_up = 3,
    base_down = 4,
    draft_up = 5,
    draft_down_t = 6
};

// The checksums of every layer with checksum_offset != 0, read from the sidecar (one read per table).
// Throws IoError (truncated file) or std::invalid_argument (a layer has one table offset but not the other).
std::vector<LayerChecksums> read_checksums(const FileReader & sidecar, const std::vector<LayerSpec> & layers);

// The RowSource of a layer's row set, with the paths and the way out for its file.
RowSource row_source(const LayerSpec & s, RowSet set, const std::string & sidecar_path, const std::string & base_path);

}  // namespace llamaflash
