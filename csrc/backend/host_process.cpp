// host_process.cpp — see host_process.h.
#include "backend/host_process.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

namespace llamaflash {

std::vector<std::string> process_args() {
    std::ifstream f("/proc/self/cmdline", std::ios::binary);
    const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::vector<std::string> args;
    size_t start = 0;
    for (size_t i = 0; i < all.size(); ++i) {
        if (all[i] == '\0') {
            args.push_back(all.substr(start, i - start));
            start = i + 1;
        }
    }
    return args;
}

std::optional<std::string> tool_option(const std::vector<std::string> & args, const std::vector<std::string> & flags,
                                       const char * env) {
    std::optional<std::string> value;
    for (size_t i = 1; i < args.size(); ++i) {
        for (const std::string & flag : flags) {
            if (args[i] == flag && i + 1 < args.size()) {
                value = args[i + 1];
            } else if (args[i].rfind(flag + "=", 0) == 0) {
                value = args[i].substr(flag.size() + 1);
            }
        }
    }
    if (!value && env != nullptr) {
        if (const char * v = std::getenv(env)) {
            value = std::string(v);
        }
    }
    return value;
}

int requested_parallel(const std::vector<std::string> & args) {
    if (auto v = tool_option(args, {"-np", "--parallel"}, "LLAMA_ARG_N_PARALLEL")) {
        return std::atoi(v->c_str());
    }
    const std::string program = args.empty() ? "" : args[0].substr(args[0].find_last_of('/') + 1);
    return program.find("llama-server") != std::string::npos ? -1 : 1;
}

std::vector<int> open_descriptors(const std::string & path) {
    std::vector<int> out;
    struct stat want{};
    if (::stat(path.c_str(), &want) != 0) {
        return out;
    }
    DIR * dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) {
        return out;
    }
    while (const dirent * e = ::readdir(dir)) {
        if (e->d_name[0] == '.') continue;
        struct stat st{};
        const std::string fd_path = std::string("/proc/self/fd/") + e->d_name;
        if (::stat(fd_path.c_str(), &st) == 0 && st.st_dev == want.st_dev && st.st_ino == want.st_ino) {
            out.push_back(std::atoi(e->d_name));
        }
    }
    ::closedir(dir);
    return out;
}

LockOutcome lock_mapped_ranges(const std::string & path, const std::vector<std::pair<uint64_t, uint64_t>> & ranges) {
    LockOutcome out;
    struct stat want{};
    if (::stat(path.c_str(), &want) != 0) {
        return out;
    }
    struct Mapping {
        uintptr_t start, end;
        uint64_t offset;  // file offset of `start` (page-aligned, as mmap requires)
    };
    std::vector<Mapping> maps;
    std::ifstream f("/proc/self/maps");
    std::string line;
    while (std::getline(f, line)) {
        uintptr_t start = 0, end = 0;
        unsigned long long offset = 0, inode = 0;
        unsigned major = 0, minor = 0;
        char perms[8] = {0};
        if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " %7s %llx %x:%x %llu", &start, &end, perms, &offset,
                        &major, &minor, &inode) == 7 &&
            inode == static_cast<unsigned long long>(want.st_ino) && makedev(major, minor) == want.st_dev) {
            maps.push_back({start, end, offset});
        }
    }
    out.mapped = !maps.empty();
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    for (const auto & [offset, size] : ranges) {
        const uint64_t lo_file = offset / page * page, hi_file = (offset + size + page - 1) / page * page;
        for (const Mapping & m : maps) {
            const uint64_t lo = std::max(lo_file, m.offset), hi = std::min(hi_file, m.offset + (m.end - m.start));
            if (lo >= hi) continue;
            if (::mlock(reinterpret_cast<void *>(m.start + (lo - m.offset)), hi - lo) == 0) {
                out.locked += hi - lo;
            } else {
                out.failed += hi - lo;
                out.error = errno;
            }
        }
    }
    return out;
}

}  // namespace llamaflash
