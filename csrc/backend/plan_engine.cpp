// plan_engine.cpp — see plan_engine.h.
#include "backend/plan_engine.h"

#include "backend/weight_registry.h"

#include "ggml.h"

#include <stdexcept>
#include <tuple>
#include <utility>

namespace llamaflash {

int PlanEngine::bound_count() const { return dense ? dense->bound_count() : experts->bound_count(); }

void PlanEngine::begin_model_load() const {
    if (dense) {
        WeightRegistry::instance().set_pending(dense);
    } else {
        WeightRegistry::instance().set_pending_experts(experts);
    }
}

std::shared_ptr<PlanEngine> open_plan(const std::string & path) {
    Plan plan = read_plan(path);
    auto engine = std::make_shared<PlanEngine>();
    engine->identity = plan.identity;
    const PlanIdentity & id = engine->identity;
    if (id.ggml_commit != ggml_commit() || id.ggml_version != ggml_version()) {
        throw std::runtime_error("the plan '" + path + "' was made with ggml " + id.ggml_version + " (commit " +
                                 id.ggml_commit + "), this process runs ggml " + ggml_version() + " (commit " +
                                 ggml_commit() +
                                 "); run `llamaflash env` again from the llamaflash installed beside "
                                 "these tools");
    }
    for (auto [file, size, mtime] : {std::tuple{id.model_path, id.model_size, id.model_mtime_ns},
                                     std::tuple{id.sidecar_path, id.sidecar_size, id.sidecar_mtime_ns}}) {
        const std::string changed = file_changed(file, size, mtime);
        if (!changed.empty()) {
            throw std::runtime_error(changed + "; run `llamaflash env " + id.model_path + " ...` again");
        }
    }
    if (plan.dense) {
        engine->expected_weights = 3 * static_cast<int>(plan.dense->layers.size());
        engine->dense = FlashModel::open(std::move(*plan.dense));
    } else {
        for (const ExpertLayerSpec & s : plan.experts->layers) {
            engine->expected_weights += static_cast<int>(s.tensors.size());
        }
        engine->experts = ExpertModel::open(std::move(*plan.experts));
    }
    return engine;
}

}  // namespace llamaflash
