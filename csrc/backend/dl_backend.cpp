// dl_backend.cpp — libllamaflash_backend.so: the llamaflash ggml backend as a library that stock
// llama.cpp tools load at start (ggml_backend_load_all() loads the file named by GGML_BACKEND_PATH).
//
// Contract with ggml's loader (ggml-backend-reg.cpp, load_backend): it calls ggml_backend_score()
// first, and a score of 0 refuses the library; then ggml_backend_init(), whose registry must carry
// GGML_BACKEND_API_VERSION. The tools pass no parameters, so the configuration is the plan file named
// by LLAMAFLASH_PLAN (plan_reader.h), written by `llamaflash env`, opened by open_plan (plan_reader.h)
// exactly as llamaflash.Llama opens the plan it makes.
//
// Every check runs in ggml_backend_score(), before anything is registered; each failure prints one
// line on stderr (why, and what to do) and scores 0, so the tool runs exactly as stock:
//   - the ggml in the process is not the one this library was compiled against (the backend ABI is
//     not stable across llama.cpp builds): ggml_commit() / ggml_version();
//   - no plan, an unreadable plan, a plan made with another ggml, a model or sidecar changed since;
//   - parallel sequences (llama-server's --parallel, auto by default): the plan serves one;
//   - the engine cannot be opened (bad configuration values, integrity failures: its own message).
// Checks that need the model being loaded run when llama.cpp first offers the device a weight of a
// served name: the plan's model file must be the one the loader has open, and the weight's shape and
// type the plan's; otherwise the device declines every weight (one line), so the model loads stock.
// At the first graph compute every weight the plan serves must have landed on the device; if not
// (e.g. `-ot` moved one), the compute fails with one line instead of computing on a partial model.
// Then, for an MoE model, the plan's dense part is locked in RAM (mlock), as llamaflash.Llama does
// after load.
#include "backend/flash_backend.h"
#include "backend/host_process.h"
#include "backend/plan_reader.h"
#include "backend/weight_registry.h"
#include "experts/expert_model.h"
#include "ggml-backend-impl.h"
#include "model/flash_model.h"
#include "plan_keys.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#ifndef LLAMAFLASH_GGML_COMMIT
#error "LLAMAFLASH_GGML_COMMIT (ggml_commit() of the libggml linked) must be defined by the build"
#endif
#ifndef LLAMAFLASH_GGML_VERSION
#error "LLAMAFLASH_GGML_VERSION must be defined by the build"
#endif

namespace llamaflash {

namespace {

namespace pk = plan_keys;

// One line on stderr, prefixed; the tools print their own logs there too.
void say(const std::string & line) { std::fprintf(stderr, "llamaflash: %s\n", line.c_str()); }

void refuse(const std::string & why, const std::string & fix) {
    say("not active: " + why + ". " + fix + ". This run is stock llama.cpp.");
}

std::shared_ptr<PlanEngine> g_loaded;  // set by a successful score(); lives for the process
std::mutex g_gate_mu;
bool g_model_admitted = false;  // the plan's model was recognised at its first weight
bool g_declined = false;        // the device declines every weight it does not hold yet
bool g_landed_checked = false;
std::vector<int> g_own_descriptors;  // the engine's own descriptors on the model file

// ---------------------------------------------------------------------------------------------
// the checks of score()

std::string build_mismatch() {
    const char * override_commit = std::getenv(pk::ENV_EXPECT_GGML_COMMIT);
    const std::string expected = override_commit != nullptr ? override_commit : LLAMAFLASH_GGML_COMMIT;
    const std::string commit = ggml_commit();
    const std::string version = ggml_version();
    if (commit == expected && version == LLAMAFLASH_GGML_VERSION) {
        return "";
    }
    return "this library was built for ggml " + std::string(LLAMAFLASH_GGML_VERSION) + " (commit " + expected +
           ") but the process runs ggml " + version + " (commit " + commit + ")";
}

// Under a RAM budget the plan counted llama.cpp's context (-c) and physical batch (-ub): a tool
// running with more would overrun the budget. "" when the tool's values are within the plan's (a
// tool's default counts when the flag is absent: -c 0 = the model's training context, -ub 512).
std::string budget_flags_mismatch(const std::vector<std::string> & args, const char * plan_path) {
    PlanIdentity id;
    try {
        id = read_plan(plan_path).identity;
    } catch (const std::exception &) {
        return "";  // reported by open_plan
    }
    if (id.ram_budget_mb <= 0) return "";
    const std::string program = args.empty() ? "" : args[0].substr(args[0].find_last_of('/') + 1);
    const bool bench = program.find("llama-bench") != std::string::npos;  // sizes its context itself
    struct Flag {
        std::vector<std::string> names;
        const char * env;
        long planned;
        long fallback;
    };
    const Flag flags[] = {{{"-c", "--ctx-size"}, "LLAMA_ARG_CTX_SIZE", static_cast<long>(id.n_ctx), 0},
                          {{"-ub", "--ubatch-size"}, "LLAMA_ARG_UBATCH", static_cast<long>(id.n_ubatch), 512}};
    for (const Flag & f : flags) {
        if (bench && f.names[0] == "-c") continue;
        const auto v = tool_option(args, f.names, f.env);
        const long value = v ? std::atol(v->c_str()) : f.fallback;
        if (f.planned > 0 && (value <= 0 || value > f.planned)) {
            return "the plan for " + std::to_string(static_cast<int>(id.ram_budget_mb)) + " MiB counted " + f.names[0] +
                   " " + std::to_string(f.planned) + " and this tool runs " + f.names[0] + " " +
                   (v ? *v : std::string("(default)"));
        }
    }
    return "";
}

int score_once() {
    const std::string mismatch = build_mismatch();
    if (!mismatch.empty()) {
        refuse(mismatch,
               "Install the llamaflash built with the llama-cpp-python whose libraries these tools use "
               "(scripts/build_llama_tools.sh builds matching tools)");
        return 0;
    }
    const char * plan_path = std::getenv(pk::ENV_PLAN);
    if (plan_path == nullptr || *plan_path == '\0') {
        refuse(std::string("no configuration (") + pk::ENV_PLAN + " is not set)",
               "Run eval \"$(llamaflash env MODEL --ram-budget-mb N)\" first");
        return 0;
    }
    const std::vector<std::string> args = process_args();
    const int parallel = requested_parallel(args);
    if (parallel != 1) {
        refuse("the tool decodes " + (parallel < 0 ? std::string("several (auto)") : std::to_string(parallel)) +
                   " parallel sequences and a plan serves one",
               "Pass -np 1 (--parallel 1)");
        return 0;
    }
    const std::string budget = budget_flags_mismatch(args, plan_path);
    if (!budget.empty()) {
        refuse(budget, "Pass the flags `llamaflash env` printed ($LLAMAFLASH_TOOL_ARGS)");
        return 0;
    }
    try {
        g_loaded = open_plan(plan_path);
    } catch (const std::exception & e) {
        refuse(e.what(), "Fix the above, or unset GGML_BACKEND_PATH");
        return 0;
    }
    const PlanIdentity & id = g_loaded->identity;
    g_own_descriptors = open_descriptors(id.model_path);
    g_loaded->begin_model_load();
    say("active: '" + id.model_path + "' served from '" + id.sidecar_path + "' (" + id.mode +
        (id.ram_budget_mb > 0 ? ", ram budget " + std::to_string(static_cast<int>(id.ram_budget_mb)) + " MiB" : "") +
        "); " + id.reason);
    return 1;
}

// ---------------------------------------------------------------------------------------------
// the device's gate: llama.cpp offers it a weight of a served name only for the plan's model

// "" when `w` (a weight llama.cpp offers the device, not bound yet) has the plan's shape and type.
std::string weight_mismatch(const ggml_tensor * w) {
    int layer = -1;
    FfnWeightKind kind;
    ExpertTensorKind expert_kind;
    auto differs = [&](int64_t ne0, int64_t ne1, int64_t ne2, int type) {
        if (w->ne[0] == ne0 && w->ne[1] == ne1 && w->ne[2] == ne2 && w->type == type) return std::string();
        return std::string("weight '") + w->name + "' is " + ggml_type_name(w->type) + " [" + std::to_string(w->ne[0]) +
               ", " + std::to_string(w->ne[1]) + ", " + std::to_string(w->ne[2]) + "], the plan's " +
               ggml_type_name(static_cast<ggml_type>(type)) + " [" + std::to_string(ne0) + ", " + std::to_string(ne1) +
               ", " + std::to_string(ne2) + "]";
    };
    if (g_loaded->dense && parse_ffn_weight_name(w->name, &layer, &kind)) {
        const int pos = g_loaded->dense->layer_position(layer);
        if (pos < 0) return "";
        const LayerSpec & s = g_loaded->dense->layers()[pos];
        switch (kind) {
            case FfnWeightKind::gate: return differs(s.n_embd, s.n_ff, 1, s.gate_type);
            case FfnWeightKind::up: return differs(s.n_embd, s.n_ff, 1, s.up_type);
            case FfnWeightKind::down: return differs(s.n_ff, s.n_embd, 1, s.down_type);
        }
    }
    if (g_loaded->experts && parse_expert_weight_name(w->name, &layer, &expert_kind)) {
        const int pos = g_loaded->experts->position(layer);
        if (pos < 0) return "";
        const ExpertTensorSpec * t = g_loaded->experts->tensor(pos, expert_kind);
        if (t == nullptr) return std::string("weight '") + w->name + "' is not in the plan";
        return differs(t->ne0, t->ne1, g_loaded->experts->layer_spec(pos).n_expert, t->type);
    }
    return "";
}

// llama.cpp's loader has the plan's model file open: a descriptor on it that the engine did not open.
bool loader_has_model_open() {
    for (int fd : open_descriptors(g_loaded->identity.model_path)) {
        if (std::find(g_own_descriptors.begin(), g_own_descriptors.end(), fd) == g_own_descriptors.end()) {
            return true;
        }
    }
    return false;
}

void decline_all(const std::string & why) {
    g_declined = true;
    WeightRegistry::instance().clear_pending();
    refuse(why, "Run `llamaflash env` for the model you load (or load '" + g_loaded->identity.model_path + "')");
}

// The weight an op would put on the device, if it is one the plan serves by name and not bound yet.
const ggml_tensor * unbound_served_weight(const ggml_tensor * op) {
    if (op->op != GGML_OP_MUL_MAT && op->op != GGML_OP_MUL_MAT_ID) return nullptr;
    const ggml_tensor * w = op->src[0];
    if (w == nullptr || WeightRegistry::instance().lookup(w) != nullptr) return nullptr;
    return WeightRegistry::instance().pending_serves(w->name) ? w : nullptr;
}

ggml_backend_device_i g_core_device_iface;
ggml_status (*g_core_graph_compute)(ggml_backend_t, ggml_cgraph *) = nullptr;

bool gated_supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    if (g_loaded == nullptr) return false;
    if (const ggml_tensor * w = unbound_served_weight(op)) {
        std::lock_guard<std::mutex> lock(g_gate_mu);
        if (g_declined) return false;
        if (g_loaded->bound_count() >= g_loaded->expected_weights) {
            // the plan's model is loaded: a later model with the same names is not served
            WeightRegistry::instance().clear_pending();
            return false;
        }
        if (!g_model_admitted) {
            if (!loader_has_model_open()) {
                decline_all("the model being loaded is not '" + g_loaded->identity.model_path +
                            "', the model the plan was made for");
                return false;
            }
            g_model_admitted = true;
        }
        const std::string mismatch = weight_mismatch(w);
        if (!mismatch.empty()) {
            decline_all("the model being loaded does not match the plan: " + mismatch);
            return false;
        }
    }
    return g_core_device_iface.supports_op(dev, op);
}

// An MoE model's dense part (every weight but the routed experts; the plan's lock ranges) locked in
// llama.cpp's mapping of the base file once the model is loaded, as llamaflash.Llama does after load,
// so the expert cache's memory pressure cannot evict it. One line says what was locked.
void lock_dense_part() {
    const std::string & model = g_loaded->identity.model_path;
    const LockOutcome lock = lock_mapped_ranges(model, g_loaded->lock_ranges);
    if (!lock.mapped) {
        say("the model is not memory-mapped (--no-mmap): its dense part is in llama.cpp's own buffers, nothing to "
            "lock");
    } else if (lock.failed > 0) {
        say("could not lock " + std::to_string(lock.failed >> 20) + " of " +
            std::to_string((lock.locked + lock.failed) >> 20) +
            " MiB of the dense part in RAM (mlock: " + std::strerror(lock.error) +
            "); it runs, but memory pressure can evict it: raise the locked-memory limit (ulimit -l)");
    } else {
        say("locked the dense part in RAM: " + std::to_string(lock.locked >> 20) + " MiB (mlock)");
    }
}

ggml_status checked_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph) {
    {
        std::lock_guard<std::mutex> lock(g_gate_mu);
        if (!g_landed_checked) {
            const int bound = g_loaded->bound_count();
            if (bound != g_loaded->expected_weights) {
                say("error: llama.cpp placed " + std::to_string(bound) + " of the " +
                    std::to_string(g_loaded->expected_weights) +
                    " weights the plan serves on the llamaflash device, "
                    "so the model cannot be served; remove tensor overrides (-ot) of FFN or expert weights, or unset "
                    "GGML_BACKEND_PATH");
                return GGML_STATUS_FAILED;
            }
            g_landed_checked = true;
            WeightRegistry::instance().clear_pending();
            if (g_loaded->experts) lock_dense_part();
        }
    }
    return g_core_graph_compute(backend, cgraph);
}

ggml_backend_t gated_init_backend(ggml_backend_dev_t dev, const char * params) {
    ggml_backend_t backend = g_core_device_iface.init_backend(dev, params);
    if (backend != nullptr) {
        g_core_graph_compute = backend->iface.graph_compute;
        backend->iface.graph_compute = checked_graph_compute;
    }
    return backend;
}

// The registry handed to ggml: the core's, with one device whose supports_op and backends are gated.
ggml_backend_reg g_reg;
ggml_backend_device g_device;

ggml_backend_dev_t gated_get_device(ggml_backend_reg_t, size_t index) { return index == 0 ? &g_device : nullptr; }

ggml_backend_reg_t make_registry() {
    ggml_backend_reg_t core = backend_reg();
    ggml_backend_dev_t core_device = core->iface.get_device(core, 0);
    g_core_device_iface = core_device->iface;
    g_reg = *core;
    g_reg.iface.get_device = gated_get_device;
    g_device = *core_device;
    g_device.reg = &g_reg;
    g_device.iface.supports_op = gated_supports_op;
    g_device.iface.init_backend = gated_init_backend;
    return &g_reg;
}

// One line at process exit saying what the device served: how a user sees that it was active.
struct ExitReport {
    ~ExitReport() {
        if (g_loaded == nullptr) return;
        if (g_loaded->dense) {
            const FlashStatsSnapshot st = g_loaded->dense->stats().snapshot();
            std::string reads;
            const OffloadState * off = g_loaded->dense->offload();
            char wait[32];
            if (const NeuronCache * cache = off != nullptr ? off->cache() : nullptr) {
                // the neuron cache's reads from flash after its pinned clusters (llamaflash.Llama's
                // flash_stats()["offload"]: misses + prefetched clusters, bytes_read, io_wait_seconds)
                const NeuronCacheStats c = cache->stats();
                std::snprintf(wait, sizeof wait, "%.2f", c.io_wait_seconds);
                reads = "; flash reads: " + std::to_string(c.misses + c.prefetched) + " clusters, " +
                        std::to_string(c.bytes_read >> 20) + " MiB, I/O wait " + wait + " s";
            } else if (const LayerStream * stream = off != nullptr ? off->layer_stream() : nullptr) {
                const LayerStreamStats c = stream->stats();  // whole layers (deterministic answers)
                std::snprintf(wait, sizeof wait, "%.2f", c.io_wait_seconds);
                reads = "; flash reads: " + std::to_string(c.misses + c.prefetched) + " layers, " +
                        std::to_string(c.bytes_read >> 20) + " MiB, I/O wait " + wait + " s";
            }
            say("served " + std::to_string(st.ffn_evals) + " FFN evaluations (" + std::to_string(st.tokens) +
                " tokens; dense lane " + std::to_string(st.dense_lane_calls) + ", sparse lane " +
                std::to_string(st.sparse_lane_calls) + " splits" + reads + ")");
        } else {
            const ExpertModel::LaneStats l = g_loaded->experts->lane_stats();
            const ExpertCacheStats c = g_loaded->experts->cache().stats();
            say("served " + std::to_string(l.splits) + " expert splits (" + std::to_string(l.tokens) + " tokens; " +
                std::to_string(c.hits) + " cache hits, " + std::to_string(c.misses) + " misses, " +
                std::to_string(c.bytes_read >> 20) + " MiB read)");
        }
    }
} g_exit_report;

int score() {
    static std::once_flag once;
    static int result = 0;
    std::call_once(once, [] { result = score_once(); });
    return result;
}

ggml_backend_reg_t init() {
    if (score() == 0) return nullptr;
    static std::once_flag once;
    static ggml_backend_reg_t reg = nullptr;
    std::call_once(once, [] { reg = make_registry(); });
    return reg;
}

}  // namespace

}  // namespace llamaflash

// The two entry points ggml's loader looks up by name (what GGML_BACKEND_DL_IMPL /
// GGML_BACKEND_DL_SCORE_IMPL declare in a backend built inside ggml).
extern "C" {
__attribute__((visibility("default"))) ggml_backend_reg_t ggml_backend_init(void) { return llamaflash::init(); }
__attribute__((visibility("default"))) int ggml_backend_score(void) { return llamaflash::score(); }
}
