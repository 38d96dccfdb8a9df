// plan_engine.h — a plan file opened into the engine it describes: the one way both hosts configure
// llamaflash. The backend library that stock llama.cpp tools load (dl_backend.cpp) opens the file
// LLAMAFLASH_PLAN names; llamaflash.Llama (bindings/plan.cpp) opens the plan it has just planned,
// serialised by plugin/files/plan_file.py. Either way the same reader (plan_reader.h), the same checks
// and the same engine constructors run, and the weight registry is armed the same way.
#pragma once

#include "backend/plan_reader.h"
#include "experts/expert_model.h"
#include "model/flash_model.h"

#include <memory>
#include <string>

namespace llamaflash {

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
