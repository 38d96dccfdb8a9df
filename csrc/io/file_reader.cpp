// file_reader.cpp — see file_reader.h.
#include "io/file_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstring>

namespace llamaflash {

FileReader::FileReader(const std::string & path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
        throw IoError("cannot open '" + path + "': " + std::strerror(errno));
    }
    struct stat st{};
    if (::fstat(fd_, &st) != 0) {
        const int err = errno;
        ::close(fd_);
        throw IoError("cannot stat '" + path + "': " + std::strerror(err));
    }
    size_ = static_cast<uint64_t>(st.st_size);
    mtime_sec_ = static_cast<int64_t>(st.st_mtim.tv_sec);
    mtime_nsec_ = static_cast<int64_t>(st.st_mtim.tv_nsec);
}

void FileReader::check_size() const {
    struct stat st{};
    std::string what;
    if (::fstat(fd_, &st) != 0) {
        what = std::string("it cannot be inspected: ") + std::strerror(errno);
    } else if (static_cast<uint64_t>(st.st_size) < size_) {
        what = "it shrank from " + std::to_string(size_) + " to " + std::to_string(st.st_size) + " bytes (truncated)";
    } else if (static_cast<uint64_t>(st.st_size) != size_) {
        what = "its size changed from " + std::to_string(size_) + " to " + std::to_string(st.st_size) + " bytes";
    }
    if (!what.empty()) {
        throw IoError("'" + path_ + "' changed while in use: " + what +
                      "; restore the file or re-create it (llamaflash convert --force), then load the model again");
    }
}

bool FileReader::modified() const {
    struct stat st{};
    return ::fstat(fd_, &st) != 0 || st.st_mtim.tv_sec != mtime_sec_ || st.st_mtim.tv_nsec != mtime_nsec_;
}

void FileReader::accept_modified() {
    struct stat st{};
    if (::fstat(fd_, &st) == 0) {
        mtime_sec_ = static_cast<int64_t>(st.st_mtim.tv_sec);
        mtime_nsec_ = static_cast<int64_t>(st.st_mtim.tv_nsec);
    }
}

FileReader::~FileReader() {
    if (fd_ >= 0) {
        ::close(fd_);
    }
}

void FileReader::check_range(uint64_t offset, uint64_t n) const {
    if (offset + n > size_) {
        throw IoError("'" + path_ + "' is truncated: need bytes [" + std::to_string(offset) + ", " +
                      std::to_string(offset + n) + ") but the file has " + std::to_string(size_) +
                      " bytes; re-create it (llamaflash convert --force) or restore the original");
    }
}

void FileReader::read_exact(void * dst, size_t n, uint64_t offset) const {
    check_range(offset, n);
    auto * out = static_cast<uint8_t *>(dst);
    size_t done = 0;
    while (done < n) {
        const ssize_t r = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            throw IoError("read error in '" + path_ + "' at offset " + std::to_string(offset + done) + ": " +
                          std::strerror(errno));
        }
        if (r == 0) {
            throw IoError("unexpected end of '" + path_ + "' at offset " + std::to_string(offset + done) +
                          " (file truncated or replaced while in use)");
        }
        done += static_cast<size_t>(r);
    }
}

void FileReader::drop_cache(uint64_t offset, uint64_t n) const {
    (void)::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(n), POSIX_FADV_DONTNEED);
}

MappedFile::MappedFile(const std::string & path, uint64_t offset, uint64_t length) {
    FileReader file(path);
    if (length == UINT64_MAX) {
        length = file.size() - std::min(offset, file.size());
    }
    file.check_range(offset, length);
    size_ = length;
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t begin = offset & ~(page - 1);
    mapped_ = offset + length - begin;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        throw IoError("cannot open '" + path + "': " + std::strerror(errno));
    }
    addr_ = ::mmap(nullptr, mapped_, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(begin));
    const int err = errno;
    ::close(fd);
    if (addr_ == MAP_FAILED) {
        addr_ = nullptr;
        throw IoError("cannot map '" + path + "': " + std::strerror(err));
    }
    data_ = static_cast<const uint8_t *>(addr_) + (offset - begin);
}

MappedFile::~MappedFile() {
    if (addr_ != nullptr) {
        ::munmap(addr_, mapped_);
    }
}

}  // namespace llamaflash
