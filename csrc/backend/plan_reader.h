// plan_reader.h — the plan file (docs/TOOLS.md, "The plan file"): one served model's engine
// configuration and what it was made for, read without Python.
//
// `llamaflash env` (plugin/files/plan_file.py) writes it as a GGUF of key-value pairs (keys:
// plugin/files/plan_keys.py, generated into plan_keys.h); the backend library (dl_backend.cpp) reads
// it at load with ggml's gguf.h and opens the same engine llamaflash.Llama opens:
//   kind "dense"   : an EngineConfig (engine_config.h) — in memory (dense / sparse lane) or offload
//   kind "experts" : an ExpertConfig (expert_cache.h) — an MoE model's routed experts from flash
#pragma once

#include "experts/expert_cache.h"
#include "model/engine_config.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace llamaflash {

// What a plan was made for and with; checked against the process and the files before it is used.
struct PlanIdentity {
    int64_t format = 0;
    std::string kind;  // plan_keys::KIND_DENSE | KIND_EXPERTS
    std::string mode;  // "dense" | "sparse" | "offload" | "experts"
    std::string reason;
    std::string ggml_commit, ggml_version;  // of the llama_cpp the plan was made with
    std::string model_path, sidecar_path;   // absolute
    uint64_t model_size = 0, model_mtime_ns = 0;
    uint64_t sidecar_size = 0, sidecar_mtime_ns = 0;
    float ram_budget_mb = 0.0f;  // 0: in memory
    uint32_t n_ctx = 0, n_batch = 0, n_ubatch = 0;
    std::string tool_args;  // the tool flags the plan assumes
};

struct Plan {
    PlanIdentity identity;
    std::optional<EngineConfig> dense;    // kind "dense"
    std::optional<ExpertConfig> experts;  // kind "experts"
    // kind "experts": the dense part of the base file, locked in RAM after load: (offset, size) byte
    // ranges, page-aligned, sorted, non-empty (expert_runtime.dense_ranges)
    std::vector<std::pair<uint64_t, uint64_t>> lock_ranges;
};

// Reads `path`. Throws std::runtime_error naming the file and the missing or ill-typed key, or a
// format version other than plan_keys::FORMAT_VERSION. Expert routers are read from the base file
// (as float32) here; nothing else touches the model or the sidecar.
Plan read_plan(const std::string & path);

// "" when `path` still has the size and modification time the plan recorded, else why not.
std::string file_changed(const std::string & path, uint64_t size, uint64_t mtime_ns);

}  // namespace llamaflash
