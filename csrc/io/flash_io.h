// flash_io.h — asynchronous reads of many byte ranges of one file (the sidecar) into caller memory,
// with direct I/O where the filesystem allows it. This is how FFN neuron bundles come from flash.
//
// Engines. Two engines give byte-identical results: "io_uring" (raw io_uring syscalls, no liburing;
// one I/O thread per reader owns the ring) and "pool" (queue_depth threads calling pread). "auto"
// picks io_uring when the kernel allows it (/proc/sys/kernel/io_uring_disabled, io_uring_setup
// succeeding), else the pool; engine_note() says why.
//
// Direct I/O. With direct = true the file is opened O_DIRECT. If the filesystem refuses it (open
// fails with EINVAL), reports no direct-I/O support (statx STATX_DIOALIGN with alignment 0), or is
// memory-backed (tmpfs, ramfs: O_DIRECT accepted but meaningless), the reader falls back to buffered
// reads: direct() is false and fallback_reason() says why; the Python layer turns that into a warning.
//
// Alignment contract. alignment() is the unit (a power of two, >= 512) that O_DIRECT needs for file
// offsets, lengths and memory addresses (statx dio alignment, else the device's logical block size,
// else 4096); in buffered mode it is still reported but not needed. Requests need NOT be aligned:
// a request whose offset, length and destination are all multiples of alignment() is read straight
// into its destination; any other request is read as its covering aligned range into a bounce buffer
// and copied (one extra memcpy on the I/O thread). Lay cache slots out with AlignedBuffer and aligned
// offsets/lengths to avoid the copy. Requests larger than max_op_bytes are split into several reads.
//
// Faults. Every failure of a batch (an errno from the kernel, EIO included; a short read because the
// file was truncated; a file replaced on disk) surfaces as IoError from wait(), naming the file, the
// offset and length, and the cause; bytes in the failed request's destination are then unspecified.
// EINTR/EAGAIN are retried, partial reads are resumed; nothing waits forever on a failed read.
#pragma once

#include "io/file_reader.h"  // IoError

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace llamaflash {

// Heap memory aligned for direct I/O (posix_memalign), contents uninitialised, move-only.
class AlignedBuffer {
public:
    AlignedBuffer() = default;
    // Throws std::bad_alloc when allocation fails; `alignment` must be a power of two >= sizeof(void*).
    AlignedBuffer(size_t size, size_t alignment = 4096);
    ~AlignedBuffer();
    AlignedBuffer(AlignedBuffer && other) noexcept;
    AlignedBuffer & operator=(AlignedBuffer && other) noexcept;
    AlignedBuffer(const AlignedBuffer &) = delete;
    AlignedBuffer & operator=(const AlignedBuffer &) = delete;

    uint8_t * data() const { return data_; }
    size_t size() const { return size_; }

private:
    uint8_t * data_ = nullptr;
    size_t size_ = 0;
};

// One range to read: bytes [offset, offset + length) of the file into dst[0, length).
// dst must stay valid and untouched by the caller until the batch holding it has been waited for
// (or the reader destroyed). length 0 is allowed and reads nothing.
struct ReadRequest {
    uint64_t offset = 0;
    uint64_t length = 0;
    void * dst = nullptr;
};

enum class IoEngineKind { Auto, IoUring, Pool };
// "auto" | "io_uring" | "pool"; std::invalid_argument naming the accepted names otherwise.
IoEngineKind parse_io_engine(const std::string & name);

struct FlashReaderOptions {
    IoEngineKind engine = IoEngineKind::Auto;
    unsigned queue_depth = 32;        // kernel reads in flight at most (pool: number of threads); 1..1024
    bool direct = true;               // try O_DIRECT (see the fallback rules above)
    uint64_t max_op_bytes = 1 << 20;  // requests are split into reads of at most this (rounded to alignment)
};

// Counters since the reader was opened. bytes_requested counts what callers asked for; bytes_read
// what the kernel delivered (alignment padding and resumed reads included).
struct FlashReaderStats {
    uint64_t batches = 0;   // submit() calls
    uint64_t requests = 0;  // ReadRequests submitted (length > 0)
    uint64_t bytes_requested = 0;
    uint64_t reads = 0;  // kernel reads issued (pread calls / SQEs), resumptions and retries included
    uint64_t bytes_read = 0;
    uint64_t bounced = 0;  // reads that went through a bounce buffer (unaligned requests)
    uint64_t resumed = 0;  // partial reads continued with a further read
    uint64_t retried = 0;  // reads repeated after EINTR/EAGAIN
    uint64_t errors = 0;   // failed reads (each fails its batch)
    uint64_t wait_calls = 0;
    uint64_t wait_ns = 0;  // time spent blocked in wait()
    std::string engine;    // "io_uring" or "pool"
    bool direct = false;
};

class FlashReader {
public:
    using Ticket = uint64_t;

    // Opens `path` (a regular file or block device) and starts the engine. Throws IoError when the
    // file cannot be opened or is not a regular file, and when an explicitly requested engine is
    // unavailable; std::invalid_argument on bad options.
    explicit FlashReader(const std::string & path, const FlashReaderOptions & options = {});

    // Cancels reads not yet handed to the kernel, waits for those in flight (never leaves the kernel
    // writing into freed memory), then closes the file. Must not run concurrently with any other call.
    ~FlashReader();
    FlashReader(const FlashReader &) = delete;
    FlashReader & operator=(const FlashReader &) = delete;

    // Starts reading all `requests` as one batch and returns at once (it does not wait for the disk).
    // Throws IoError (nothing started) when a range lies outside the file as it was at open, and
    // std::invalid_argument for a null destination. Thread-safe.
    Ticket submit(const std::vector<ReadRequest> & requests);
    Ticket submit(const ReadRequest * requests, size_t n);

    // Blocks until every read of the batch finished, then forgets the ticket. Throws IoError describing
    // the first failed read of the batch; std::invalid_argument for an unknown (or already waited)
    // ticket. Thread-safe; no GIL or Python involved, so ggml compute threads may call it. Each
    // ticket must be waited exactly once, by one thread.
    void wait(Ticket ticket);

    // True when the batch has finished (successfully or not); never blocks, does not forget the
    // ticket (wait() still has to be called). Throws std::invalid_argument for an unknown ticket.
    bool poll(Ticket ticket) const;

    // Blocks until request `request` (its index in the submitted array) of the batch has finished;
    // true when it succeeded (its bytes are at dst), false when it failed (wait() reports why). Does
    // not forget the ticket: wait() still has to be called. Throws std::invalid_argument for an
    // unknown ticket or index. Lets a caller use the first parts of a batch while the rest is read.
    bool wait_request(Ticket ticket, size_t request) const;

    // submit() + wait().
    void read(const std::vector<ReadRequest> & requests);

    // Throws IoError when the file changed since it was opened: path now names another file
    // (replaced), or its size or modification time differ (truncated, rewritten). Cheap (two stats).
    void verify() const;

    const std::string & path() const;
    uint64_t file_size() const;  // at open
    size_t alignment() const;
    bool direct() const;
    const std::string & fallback_reason() const;  // empty when direct() or direct was not asked for
    const char * engine_name() const;             // "io_uring" or "pool"
    const std::string & engine_note() const;      // why auto chose the pool; empty otherwise
    unsigned queue_depth() const;
    FlashReaderStats stats() const;  // thread-safe snapshot

    // Test hook: every later kernel read whose range contains `offset` fails with errno `err`
    // (e.g. EIO) instead of reaching the kernel; err = 0 removes the fault. Not for production use.
    void inject_fault_for_testing(uint64_t offset, int err);

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

// True when io_uring_setup works for this process; otherwise `why` says what prevents it.
bool io_uring_available(std::string * why = nullptr);

// Random reads of `request_bytes` at offsets aligned to request_bytes, uniformly inside
// [region_offset, region_offset + region_bytes), `depth` requests kept in flight (one ticket each),
// for about `seconds`. The disk probe of the planner. Throws IoError like wait().
struct RandomReadResult {
    uint64_t reads = 0;
    uint64_t bytes = 0;
    double seconds = 0.0;
};
RandomReadResult measure_random_reads(FlashReader & reader, uint64_t request_bytes, unsigned depth, double seconds,
                                      uint64_t region_offset, uint64_t region_bytes, uint64_t seed);

}  // namespace llamaflash
