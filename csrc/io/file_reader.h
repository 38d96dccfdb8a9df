// file_reader.h — positional reads from a regular file with errors that name the file.
//
// MappedFile maps a whole file read-only and shared: its pages are the page cache's (file-backed,
// reclaimable), exactly like llama.cpp's own mmap of a GGUF.
//
// Contract: read_exact() either fills the whole destination or throws IoError describing the file,
// offset, size and cause (EIO, short read because the file was truncated, ...). It never returns
// partial data. drop_cache() asks the kernel to forget clean page-cache pages of a byte range; it is
// advice, never an error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace llamaflash {

class IoError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

class FileReader {
public:
    explicit FileReader(const std::string & path);
    ~FileReader();
    FileReader(const FileReader &) = delete;
    FileReader & operator=(const FileReader &) = delete;

    const std::string & path() const { return path_; }
    uint64_t size() const { return size_; }

    // Throws IoError (file truncated) unless [offset, offset + n) lies inside the file.
    void check_range(uint64_t offset, uint64_t n) const;

    // Reads exactly `n` bytes at `offset` into `dst`.
    void read_exact(void * dst, size_t n, uint64_t offset) const;

    // posix_fadvise(DONTNEED) on [offset, offset + n): drops clean cached pages of that range.
    void drop_cache(uint64_t offset, uint64_t n) const;

    // The open file (this inode) against what it was at open (or at the last accept_modified), one
    // fstat each. check_size throws IoError when its size differs (it shrank: truncated, or grew) or
    // it cannot be inspected; modified() says whether its modification time moved (rewritten in
    // place); accept_modified() takes the current time as the new reference. A file replaced under
    // the same name (a new inode) does not count: this reader still has the old one.
    void check_size() const;
    bool modified() const;
    void accept_modified();

private:
    std::string path_;
    int fd_ = -1;
    uint64_t size_ = 0;
    int64_t mtime_sec_ = 0, mtime_nsec_ = 0;
};

class MappedFile {
public:
    // Maps bytes [offset, offset + length) of the file (the whole file by default); data() points at
    // byte `offset` (the mapping itself starts at the page boundary below it).
    explicit MappedFile(const std::string & path, uint64_t offset = 0, uint64_t length = UINT64_MAX);
    ~MappedFile();
    MappedFile(const MappedFile &) = delete;
    MappedFile & operator=(const MappedFile &) = delete;

    const uint8_t * data() const { return data_; }
    // the whole mapping (page aligned; contains [data(), data() + size()))
    uint8_t * mapping() const { return static_cast<uint8_t *>(addr_); }
    uint64_t mapping_size() const { return mapped_; }
    uint64_t size() const { return size_; }

private:
    void * addr_ = nullptr;  // start of the mapping (page aligned)
    uint64_t mapped_ = 0;    // bytes mapped
    const uint8_t * data_ = nullptr;
    uint64_t size_ = 0;
};

}  // namespace llamaflash
