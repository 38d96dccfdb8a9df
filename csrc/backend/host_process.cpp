// host_process.cpp — see host_process.h.
#include "backend/host_process.h"

#include <dirent.h>
#include <sys/stat.h>
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

}  // namespace llamaflash
