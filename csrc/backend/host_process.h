// host_process.h — what the backend library can learn about the llama.cpp tool that loaded it, which
// passes it no parameters: the tool's command line (/proc/self/cmdline), its environment, the files
// it has open (/proc/self/fd) and maps (/proc/self/maps, where it locks pages). Linux only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace llamaflash {

// The process's argv (empty if /proc/self/cmdline cannot be read).
std::vector<std::string> process_args();

// The value after the last occurrence of any of `flags` in `args` ("-np 2" or "--parallel=2"),
// else the environment variable `env` (may be null), else nullopt.
std::optional<std::string> tool_option(const std::vector<std::string> & args, const std::vector<std::string> & flags,
                                       const char * env);

// Parallel sequences the tool will decode, as llama.cpp's argument parser decides it: -np/--parallel,
// else LLAMA_ARG_N_PARALLEL, else the tool's default (llama-server: -1 = auto, which it turns into 4
// slots; every other tool: 1).
int requested_parallel(const std::vector<std::string> & args);

// The descriptors of this process open on `path` (entries of /proc/self/fd that are the same file:
// device and inode). llama.cpp's model loader holds one while it places the model's weights.
std::vector<int> open_descriptors(const std::string & path);

// What lock_mapped_ranges did.
struct LockOutcome {
    bool mapped = false;  // the process maps `path` at all (llama.cpp's default mmap load)
    uint64_t locked = 0;  // bytes locked
    uint64_t failed = 0;  // bytes mlock refused
    int error = 0;        // errno of the last refusal (RLIMIT_MEMLOCK: ENOMEM / EPERM)
};

// Locks in RAM (mlock) the pages of `path`'s file ranges (offset, size) wherever the process maps
// that file (device and inode as /proc/self/maps lists them), so memory pressure cannot evict them.
// Ranges are widened to whole pages. A refusal is counted, not thrown: the pages stay evictable.
LockOutcome lock_mapped_ranges(const std::string & path, const std::vector<std::pair<uint64_t, uint64_t>> & ranges);

}  // namespace llamaflash
