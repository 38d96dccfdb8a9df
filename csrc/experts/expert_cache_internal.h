// expert_cache_internal.h — what expert_cache.cpp and expert_cache_early_reads.cpp share: a slot, a
// layer's slots and reads in flight, and the sizes of a slot's regions. Not part of the interface.
#pragma once

#include "experts/expert_cache.h"

#include <chrono>
#include <cstdint>
#include <vector>

namespace llamaflash {

namespace expert_cache_detail {

inline uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Region of one expert slice in a slot: its covering aligned extent, whatever the slice's offset
// modulo the alignment (round_up(len, A) + A >= round_up(r + len, A) for every r < A).
inline uint64_t region_bytes(uint64_t expert_bytes, uint64_t alignment) {
    return round_up(expert_bytes, alignment) + alignment;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace expert_cache_detail

struct ExpertCache::Slot {
    int expert = -1;
    enum class State { empty, loading, ready } state = State::empty;
    uint64_t last_use = 0;
    bool pinned = false;
    bool prefetched = false;   // filled by prefetch and not yet used
    bool ahead = false;        // filled by read_ahead for the layer's next request: a demand read issued early
    bool unchecked = false;    // read, checksum not yet checked
    uint64_t read_ticket = 0;  // while loading: the FlashReader batch filling it
};

struct ExpertCache::Layer {
    std::vector<uint64_t> region_offset;  // per tensor index: offset of its region within a slot
    size_t slot_stride = 0;
    AlignedBuffer memory;
    std::vector<Slot> slots;
    std::vector<int> slot_of;     // expert → slot, -1
    std::vector<char> is_pinned;  // expert → pinned
    // one prefetch() or read_ahead() batch in flight
    struct EarlyRead {
        FlashReader::Ticket ticket = 0;
        std::vector<int> slots;  // the slots it fills
    };
    std::vector<EarlyRead> early_reads;
    bool demand_pending = false;
    FlashReader::Ticket demand_ticket = 0;
    std::vector<int> demand_slots;
};

}  // namespace llamaflash
