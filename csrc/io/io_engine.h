// io_engine.h — internal to flash_io: the engines that issue kernel reads for FlashReader.
//
// An IoEngine receives IoOps (one kernel read each, already aligned for the file's mode) and calls
// the completion callback exactly once per op, from one of its own threads, when the op has
// finished: all `needed` bytes arrived, or `error`/`eof` is set. Engines retry EINTR/EAGAIN and
// resume partial reads themselves (op_result()). Destroying an engine cancels ops it has not handed
// to the kernel yet (completion with error = ECANCELED) and waits for those in flight; when the
// destructor returns no callback is running or will run, and the kernel writes no more memory.
#pragma once

#include "io/flash_io.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace llamaflash {

struct IoOp {
    // what to read (set by the reader; aligned when the file is open O_DIRECT)
    uint8_t * buf = nullptr;  // kernel destination: the caller's memory or bounce.data()
    uint64_t offset = 0;      // file offset of buf[0]
    uint64_t length = 0;      // bytes asked of the kernel
    uint64_t needed = 0;      // bytes that must arrive (< length only when the range passes EOF)
    int inject_errno = 0;     // test hook: fail with this errno instead of reading

    // progress (engine)
    uint64_t done = 0;
    int error = 0;     // errno of the failure; 0 = none
    bool eof = false;  // the file ended before `needed` bytes arrived
    unsigned retries = 0;

    // reader bookkeeping
    void * batch = nullptr;
    size_t request = 0;        // index of the ReadRequest in its batch
    uint64_t user_offset = 0;  // the caller's range this op serves (for copies and messages)
    uint64_t user_length = 0;
    uint8_t * copy_dst = nullptr;  // non-null: copy buf[user_offset - offset, +user_length) here
    AlignedBuffer bounce;
};

// Counters the engines update (FlashReaderStats draws on them).
struct IoCounters {
    std::atomic<uint64_t> reads{0}, bytes_read{0}, resumed{0}, retried{0};
};

enum class OpNext { Done, Again };

// Accounts one kernel result for `op` (res >= 0: bytes; res < 0: -errno) and says whether the op is
// finished or must be issued again for its remainder (buf + done, length - done, offset + done).
OpNext op_result(IoOp & op, int64_t res, bool direct, size_t alignment, IoCounters & counters);

using IoCompletion = std::function<void(IoOp *)>;

class IoEngine {
public:
    virtual ~IoEngine() = default;
    virtual const char * name() const = 0;
    // Queues ops for reading; returns without waiting for the disk. Thread-safe. At most
    // queue_depth ops are in the kernel at once; the rest wait in FIFO order.
    virtual void start(const std::vector<IoOp *> & ops) = 0;
};

struct IoEngineConfig {
    int fd = -1;
    unsigned queue_depth = 32;
    bool direct = false;
    size_t alignment = 4096;
    IoCounters * counters = nullptr;
    IoCompletion complete;
};

// Throws IoError when the engine cannot start (io_uring: the reason setup failed).
std::unique_ptr<IoEngine> make_pool_engine(const IoEngineConfig & config);
std::unique_ptr<IoEngine> make_io_uring_engine(const IoEngineConfig & config);

}  // namespace llamaflash
