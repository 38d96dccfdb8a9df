// integrity.cpp — see integrity.h.
#include "io/integrity.h"

#include "io/crc32c.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace llamaflash {

const char * const kIntegrityErrorPrefix = "checksum mismatch";

uint64_t verify_rows(const uint8_t * data, size_t stride, int64_t first, int64_t n, const uint32_t * expected,
                     const RowSource & src) {
    constexpr int64_t kBatch = 96;  // rows checksummed per crc32c_rows call (several at once, see crc32c.cpp)
    uint32_t crcs[kBatch];
    for (int64_t i = 0; i < n; ++i) {
        if (i % kBatch == 0) {
            crc32c_rows(data + static_cast<size_t>(i) * stride, std::min(kBatch, n - i), src.row_bytes, stride, crcs);
        }
        const int64_t r = first + i;
        const uint32_t got = crcs[i % kBatch];
        if (got != expected[r]) {
            const uint64_t at = src.offset + static_cast<uint64_t>(r) * src.row_bytes;
            char crcs[64];
            std::snprintf(crcs, sizeof crcs, "CRC-32C %08x, expected %08x", got, expected[r]);
            throw IntegrityError(std::string(kIntegrityErrorPrefix) + " in '" + src.file + "': tensor " + src.tensor +
                                 " row " + std::to_string(r) + " (bytes " + std::to_string(at) + ".." +
                                 std::to_string(at + src.row_bytes) + ") does not hold what was written (" + crcs +
                                 "); " + src.way_out);
        }
    }
    return static_cast<uint64_t>(n) * src.row_bytes;
}

uint64_t verify_file_rows(const FileReader & file, int64_t first, int64_t n, const uint32_t * expected,
                          const RowSource & src, size_t chunk_bytes, bool drop) {
    const int64_t per_chunk = std::max<int64_t>(1, static_cast<int64_t>(chunk_bytes / src.row_bytes));
    std::vector<uint8_t> buf(static_cast<size_t>(std::min(per_chunk, n)) * src.row_bytes);
    uint64_t checked = 0;
    for (int64_t r = first; r < first + n; r += per_chunk) {
        const int64_t k = std::min(per_chunk, first + n - r);
        const uint64_t at = src.offset + static_cast<uint64_t>(r) * src.row_bytes;
        const size_t bytes = static_cast<size_t>(k) * src.row_bytes;
        file.read_exact(buf.data(), bytes, at);
        checked += verify_rows(buf.data(), src.row_bytes, r, k, expected, src);
        if (drop) file.drop_cache(at, bytes);
    }
    return checked;
}

std::vector<LayerChecksums> read_checksums(const FileReader & sidecar, const std::vector<LayerSpec> & layers) {
    std::vector<LayerChecksums> out(layers.size());
    for (size_t p = 0; p < layers.size(); ++p) {
        const LayerSpec & s = layers[p];
        if ((s.checksum_offset == 0) != (s.base_down_checksum_offset == 0)) {
            throw std::invalid_argument(
                "llamaflash: layer " + std::to_string(s.layer) +
                ": checksum_offset and base_down_checksum_offset must both be set or both be 0");
        }
        if (s.checksum_offset == 0) continue;
        const size_t n_ff = static_cast<size_t>(s.n_ff);
        std::vector<uint32_t> table(4 * n_ff);
        sidecar.read_exact(table.data(), table.size() * sizeof(uint32_t), s.checksum_offset);
        LayerChecksums & c = out[p];
        std::vector<uint32_t> * columns[4] = {&c.bundle, &c.down_t, &c.base_gate, &c.base_up};
        for (int col = 0; col < 4; ++col) {
            columns[col]->resize(n_ff);
            for (size_t k = 0; k < n_ff; ++k) (*columns[col])[k] = table[4 * k + col];
        }
        c.base_down.resize(static_cast<size_t>(s.n_embd));
        sidecar.read_exact(c.base_down.data(), c.base_down.size() * sizeof(uint32_t), s.base_down_checksum_offset);
    }
    return out;
}

RowSource row_source(const LayerSpec & s, RowSet set, const std::string & sidecar_path, const std::string & base_path) {
    const std::string sidecar_way =
        "the sidecar is damaged: copy it again from the original, or re-create it with "
        "`llamaflash convert " +
        base_path + " -o " + sidecar_path + " --force`";
    const std::string base_way =
        "the base model file is damaged: copy or download it again (a sidecar converted "
        "from a damaged model would carry the damage)";
    switch (set) {
        case RowSet::bundle: return {sidecar_path, s.bundle_name, s.bundle_offset, s.bundle_stride, sidecar_way};
        case RowSet::down_t: return {sidecar_path, s.down_t_name, s.down_t_offset, s.down_t_row_bytes, sidecar_way};
        case RowSet::base_gate: return {base_path, s.base_gate_name, s.base_gate_offset, s.gate_row_bytes, base_way};
        case RowSet::base_up: return {base_path, s.base_up_name, s.base_up_offset, s.up_row_bytes, base_way};
        case RowSet::base_down:
            return {base_path, s.base_down_name, s.base_down_offset, s.base_down_row_bytes, base_way};
        case RowSet::draft_up:
            return {sidecar_path, s.draft_up_name, s.draft_up_offset, s.draft_row_bytes, sidecar_way};
        case RowSet::draft_down_t:
            return {sidecar_path, s.draft_down_t_name, s.draft_down_t_offset, s.draft_row_bytes, sidecar_way};
    }
    throw std::logic_error("row_source: unknown row set");
}

}  // namespace llamaflash
