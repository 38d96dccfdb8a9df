// plan_reader.h — the plan file (docs/TOOLS.md, "The plan file"): one served model's engine
// configuration and what it was made for, read without Python.
//
// plugin/files/plan_file.py writes it as a GGUF of key-value pairs (keys: plugin/files/plan_keys.py,
// generated into plan_keys.h), for the tools as a file (`llamaflash env`) and for llamaflash.Llama in
// memory. open_plan is the one way both hosts configure llamaflash: the backend library the llama.cpp
// tools load (dl_backend.cpp) opens the file LLAMAFLASH_PLAN names, llamaflash.Llama
// (bindings/engine.cpp, bind_plan) the plan it has just made; the same reader, checks and engine constructors
// run, and the weight registry is armed the same way:
//   kind "dense"   : an EngineConfig (engine_config.h) — in memory (dense / sparse lane) or offload
//   kind "experts" : an ExpertConfig (expert_cache.h) — an MoE model's routed experts from flash
#pragma once

#include "experts/expert_cache.h"
#include "experts/expert_model.h"
#include "model/engine_config.h"
#include "model/flash_model.h"

#include <cstdint>
#include <memory>
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

// One opened plan: its identity and exactly one engine, `dense` (kind "dense") or `experts` (kind
// "experts"). The plan's configuration moved into the engine (an MoE plan's float32 routers are not
// held twice).
struct PlanEngine {
    PlanIdentity identity;
    std::shared_ptr<FlashModel> dense;
    std::shared_ptr<ExpertModel> experts;
    // weights llama.cpp must place on the device for the model to be served: 3 per served FFN layer
    // (gate, up, down), or every routed expert tensor of every served MoE layer
    int expected_weights = 0;
    // kind "experts": the plan's lock ranges (Plan::lock_ranges), for a host that locks the dense part
    std::vector<std::pair<uint64_t, uint64_t>> lock_ranges;

    // Weights bound to the engine so far (== expected_weights once llama.cpp loaded the model).
    int bound_count() const;
    // Makes this engine the one whose weights llama.cpp's next model load places on the device
    // (WeightRegistry::set_pending / set_pending_experts); WeightRegistry::clear_pending ends it.
    void begin_model_load() const;
};

// Reads the plan at `path` (read_plan), checks that it was made with the ggml running in this process
// (ggml_commit() / ggml_version()) and that the model and the sidecar still have the size and
// modification time it recorded, then opens the engine (FlashModel::open / ExpertModel::open).
// Throws std::runtime_error naming what does not hold, and whatever the engine's open throws
// (std::invalid_argument, IoError, IntegrityError, std::runtime_error).
std::shared_ptr<PlanEngine> open_plan(const std::string & path);

}  // namespace llamaflash
