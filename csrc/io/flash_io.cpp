// flash_io.cpp — FlashReader: opening (direct or buffered), request planning (alignment, bounce
// buffers, splitting), batches and their completion, statistics. Engines: io_pool.cpp,
// io_uring_queue.cpp. See flash_io.h for the contracts.
#include "io/flash_io.h"
#include "io/io_engine.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_map>

namespace llamaflash {

// ---------------------------------------------------------------------------------------------
// AlignedBuffer

AlignedBuffer::AlignedBuffer(size_t size, size_t alignment) : size_(size) {
    void * p = nullptr;
    if (::posix_memalign(&p, std::max(alignment, sizeof(void *)), std::max<size_t>(size, 1)) != 0) {
        throw std::bad_alloc();
    }
    data_ = static_cast<uint8_t *>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer && o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
}

AlignedBuffer & AlignedBuffer::operator=(AlignedBuffer && o) noexcept {
    if (this != &o) {
        std::free(data_);
        data_ = o.data_;
        size_ = o.size_;
        o.data_ = nullptr;
        o.size_ = 0;
    }
    return *this;
}

// ---------------------------------------------------------------------------------------------
// op_result (shared by the engines)

namespace {
constexpr unsigned kMaxRetries = 1000;  // EINTR/EAGAIN in a row before the read counts as failed
}

OpNext op_result(IoOp & op, int64_t res, bool direct, size_t alignment, IoCounters & counters) {
    if (res < 0) {
        const int err = static_cast<int>(-res);
        if ((err == EINTR || err == EAGAIN) && op.retries < kMaxRetries) {
            ++op.retries;
            counters.retried.fetch_add(1, std::memory_order_relaxed);
            return OpNext::Again;
        }
        op.error = err;
        return OpNext::Done;
    }
    if (res == 0) {
        op.eof = true;
        return OpNext::Done;
    }
    op.done += static_cast<uint64_t>(res);
    counters.bytes_read.fetch_add(static_cast<uint64_t>(res), std::memory_order_relaxed);
    if (op.done >= op.needed) return OpNext::Done;
    if (direct && ((op.offset + op.done) % alignment) != 0) {
        // O_DIRECT returns a count that is not a multiple of the block only at the end of the file.
        op.eof = true;
        return OpNext::Done;
    }
    counters.resumed.fetch_add(1, std::memory_order_relaxed);
    return OpNext::Again;
}

// ---------------------------------------------------------------------------------------------
// FlashReader

namespace {

struct Batch {
    std::vector<IoOp> ops;
    std::atomic<size_t> pending{0};
    bool complete = false;  // guarded by Impl::mu
    std::string error;      // first failure; guarded by Impl::mu
    // per ReadRequest (by index in the submitted array): ops not finished, and whether one failed
    std::unique_ptr<std::atomic<uint32_t>[]> request_pending;
    std::vector<uint8_t> request_failed;  // guarded by Impl::mu
    size_t n_requests = 0;
};

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

bool is_pow2(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

}  // namespace

struct FlashReader::Impl {
    std::string path;
    FlashReaderOptions opts;
    int fd = -1;
    uint64_t size = 0;
    dev_t dev = 0;
    ino_t ino = 0;
    struct timespec mtime{};
    size_t alignment = 4096;
    bool direct = false;
    std::string fallback_reason;
    std::string engine_note;
    IoCounters counters;
    std::atomic<uint64_t> batches{0}, requests{0}, bytes_requested{0}, bounced{0}, errors{0};
    std::atomic<uint64_t> wait_calls{0}, wait_ns{0};

    mutable std::mutex mu;
    mutable std::condition_variable cv;
    std::unordered_map<Ticket, std::unique_ptr<Batch>> batches_by_ticket;
    Ticket next_ticket = 1;
    std::vector<std::pair<uint64_t, int>> faults;  // test hook; guarded by mu

    std::unique_ptr<IoEngine> engine;  // destroyed first (drains) by ~FlashReader

    void open_file();
    void choose_mode();
    void on_complete(IoOp * op);
    std::string describe_failure(const IoOp & op) const;
    std::string replaced_note() const;
};

void FlashReader::Impl::open_file() {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        const int err = errno;
        throw IoError("cannot open '" + path + "' for flash reads: " + errno_text(err) +
                      "; check the path (is the sidecar beside the model?) and its permissions");
    }
    struct stat st{};
    if (::fstat(fd, &st) != 0) {
        const int err = errno;
        throw IoError("cannot stat '" + path + "': " + errno_text(err));
    }
    if (S_ISDIR(st.st_mode)) {
        throw IoError("'" + path + "' is a directory, not a file; give the path of the sidecar file");
    }
    if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
        throw IoError("'" + path + "' is not a regular file (nor a block device); give the path of the sidecar file");
    }
    dev = st.st_dev;
    ino = st.st_ino;
    mtime = st.st_mtim;
    size = static_cast<uint64_t>(st.st_size);
    if (S_ISBLK(st.st_mode)) {
        uint64_t bytes = 0;
        if (::ioctl(fd, BLKGETSIZE64, &bytes) == 0) size = bytes;
    }
}

void FlashReader::Impl::choose_mode() {
    // Alignment: statx's direct-I/O alignment where the kernel reports it, the logical block size
    // of a block device, else 4096.
    size_t align = 0;
    bool dio_unsupported = false;
#ifdef STATX_DIOALIGN
    struct statx sx{};
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
        if (sx.stx_dio_offset_align == 0) {
            dio_unsupported = true;
        } else {
            align = std::max<size_t>(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
        }
    }
#endif
    struct stat st{};
    if (align == 0 && ::fstat(fd, &st) == 0 && S_ISBLK(st.st_mode)) {
        int lbs = 0;
        if (::ioctl(fd, BLKSSZGET, &lbs) == 0 && lbs > 0) align = static_cast<size_t>(lbs);
    }
    if (align == 0 || !is_pow2(align)) align = 4096;
    alignment = std::max<size_t>(align, 512);

    direct = false;
    if (!opts.direct) return;
    struct statfs sfs{};
    if (::fstatfs(fd, &sfs) == 0 && (sfs.f_type == TMPFS_MAGIC || sfs.f_type == RAMFS_MAGIC)) {
        fallback_reason = "the file is on a memory filesystem (tmpfs/ramfs), where O_DIRECT is meaningless";
        return;
    }
    if (dio_unsupported) {
        fallback_reason = "the filesystem reports no direct-I/O support for this file (statx)";
        return;
    }
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_DIRECT) != 0) {
        fallback_reason = "the filesystem refuses O_DIRECT: " + errno_text(errno);
        return;
    }
    direct = true;
}

std::string FlashReader::Impl::replaced_note() const {
    struct stat now{};
    if (::stat(path.c_str(), &now) != 0) {
        return "; the path no longer exists (deleted or renamed while in use)";
    }
    if (now.st_dev != dev || now.st_ino != ino) {
        return "; the path now names a different file (replaced while in use)";
    }
    return std::string();
}

std::string FlashReader::Impl::describe_failure(const IoOp & op) const {
    const std::string range = std::to_string(op.user_length) + " bytes at offset " + std::to_string(op.user_offset);
    if (op.eof) {
        struct stat st{};
        const std::string now = ::fstat(fd, &st) == 0 ? std::to_string(st.st_size) : std::string("?");
        return "'" + path + "' ended early while reading " + range + ": it has " + now + " bytes now, " +
               std::to_string(size) + " when opened (truncated or rewritten while in use)" + replaced_note() +
               "; restore the file or re-create it (llamaflash convert --force), then load the model again";
    }
    if (op.error == ECANCELED) {
        return "read of " + range + " of '" + path + "' cancelled: the reader was closed";
    }
    std::string msg = "read error in '" + path + "' reading " + range + ": " + errno_text(op.error);
    if (op.error == EIO) {
        msg +=
            "; the device reported an I/O error: check the disk (dmesg), copy the file to healthy "
            "storage or re-create it (llamaflash convert --force)";
    } else if (op.error == EINVAL && direct) {
        msg += "; the filesystem rejected an aligned O_DIRECT read: open the reader with direct=False";
    }
    return msg + replaced_note();
}

void FlashReader::Impl::on_complete(IoOp * op) {
    auto * batch = static_cast<Batch *>(op->batch);
    const bool failed = op->error != 0 || op->eof;
    if (!failed && op->copy_dst != nullptr) {
        std::memcpy(op->copy_dst, op->buf + (op->user_offset - op->offset), op->user_length);
    }
    op->bounce = AlignedBuffer();
    if (failed) {
        errors.fetch_add(1, std::memory_order_relaxed);
        std::string msg = describe_failure(*op);
        std::lock_guard<std::mutex> lock(mu);
        if (batch->error.empty()) batch->error = std::move(msg);
        batch->request_failed[op->request] = 1;
    }
    const bool request_done = batch->request_pending[op->request].fetch_sub(1, std::memory_order_acq_rel) == 1;
    if (batch->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu);
        batch->complete = true;
        cv.notify_all();
    } else if (request_done) {
        std::lock_guard<std::mutex> lock(mu);  // wait_request() sleeps on cv under mu
        cv.notify_all();
    }
}

FlashReader::FlashReader(const std::string & path, const FlashReaderOptions & options)
    : impl_(std::make_unique<Impl>()) {
    Impl & m = *impl_;
    m.path = path;
    m.opts = options;
    if (options.queue_depth < 1 || options.queue_depth > 1024) {
        throw std::invalid_argument("queue_depth must be in 1..1024, got " + std::to_string(options.queue_depth));
    }
    if (options.max_op_bytes < 4096) {
        throw std::invalid_argument("max_op_bytes must be at least 4096");
    }
    try {
        m.open_file();
        m.choose_mode();
        // Splitting keeps direct chunks aligned; io_uring lengths are 32-bit.
        m.opts.max_op_bytes = std::min<uint64_t>(m.opts.max_op_bytes, 1ull << 30);
        m.opts.max_op_bytes -= m.opts.max_op_bytes % m.alignment;

        IoEngineConfig cfg;
        cfg.fd = m.fd;
        cfg.queue_depth = options.queue_depth;
        cfg.direct = m.direct;
        cfg.alignment = m.alignment;
        cfg.counters = &m.counters;
        Impl * self = impl_.get();
        cfg.complete = [self](IoOp * op) { self->on_complete(op); };
        if (options.engine == IoEngineKind::Pool) {
            m.engine = make_pool_engine(cfg);
        } else {
            try {
                m.engine = make_io_uring_engine(cfg);
            } catch (const IoError & e) {
                if (options.engine == IoEngineKind::IoUring) throw;
                m.engine_note = e.what();
                m.engine = make_pool_engine(cfg);
            }
        }
    } catch (...) {
        if (m.fd >= 0) ::close(m.fd);
        throw;
    }
}

FlashReader::~FlashReader() {
    impl_->engine.reset();  // cancels queued reads, drains those in flight
    if (impl_->fd >= 0) ::close(impl_->fd);
}

FlashReader::Ticket FlashReader::submit(const std::vector<ReadRequest> & requests) {
    return submit(requests.data(), requests.size());
}

FlashReader::Ticket FlashReader::submit(const ReadRequest * requests, size_t n) {
    Impl & m = *impl_;
    const uint64_t A = m.alignment;
    const uint64_t chunk = m.opts.max_op_bytes;
    std::vector<std::pair<uint64_t, int>> faults;
    {
        std::lock_guard<std::mutex> lock(m.mu);
        faults = m.faults;
    }
    auto batch = std::make_unique<Batch>();
    size_t n_ops = 0;
    uint64_t bytes = 0, n_req = 0;
    for (size_t i = 0; i < n; ++i) {
        const ReadRequest & r = requests[i];
        if (r.length == 0) continue;
        if (r.dst == nullptr) throw std::invalid_argument("read request " + std::to_string(i) + " has no destination");
        if (r.offset > m.size || r.length > m.size - r.offset) {
            throw IoError("read of " + std::to_string(r.length) + " bytes at offset " + std::to_string(r.offset) +
                          " lies outside '" + m.path + "' (" + std::to_string(m.size) +
                          " bytes when opened): the file does not match the layout that asked for it; "
                          "re-create it (llamaflash convert --force)");
        }
        n_ops += (r.length + chunk - 1) / chunk;
        bytes += r.length;
        ++n_req;
    }
    batch->ops.resize(n_ops);
    batch->n_requests = n;
    batch->request_pending = std::make_unique<std::atomic<uint32_t>[]>(n);
    batch->request_failed.assign(n, 0);
    size_t k = 0;
    uint64_t bounced = 0;
    for (size_t i = 0; i < n; ++i) {
        const ReadRequest & r = requests[i];
        batch->request_pending[i].store(static_cast<uint32_t>((r.length + chunk - 1) / chunk),
                                        std::memory_order_relaxed);
        for (uint64_t pos = 0; pos < r.length; pos += chunk) {
            IoOp & op = batch->ops[k++];
            op.batch = batch.get();
            op.request = i;
            op.user_offset = r.offset + pos;
            op.user_length = std::min(chunk, r.length - pos);
            uint8_t * dst = static_cast<uint8_t *>(r.dst) + pos;
            const bool aligned =
                op.user_offset % A == 0 && op.user_length % A == 0 && reinterpret_cast<uintptr_t>(dst) % A == 0;
            if (!m.direct || aligned) {
                op.buf = dst;
                op.offset = op.user_offset;
                op.length = op.needed = op.user_length;
            } else {
                op.offset = op.user_offset - op.user_offset % A;
                const uint64_t end = op.user_offset + op.user_length;
                op.length = (end + A - 1) / A * A - op.offset;
                op.needed = end - op.offset;
                op.bounce = AlignedBuffer(op.length, std::max<size_t>(A, 4096));
                op.buf = op.bounce.data();
                op.copy_dst = dst;
                ++bounced;
            }
            for (const auto & f : faults) {
                if (f.first >= op.offset && f.first < op.offset + op.length) op.inject_errno = f.second;
            }
        }
    }
    batch->pending.store(n_ops, std::memory_order_relaxed);
    std::vector<IoOp *> ops;
    ops.reserve(n_ops);
    for (auto & op : batch->ops) ops.push_back(&op);

    Ticket ticket;
    {
        std::lock_guard<std::mutex> lock(m.mu);
        ticket = m.next_ticket++;
        batch->complete = n_ops == 0;
        m.batches_by_ticket.emplace(ticket, std::move(batch));
    }
    m.batches.fetch_add(1, std::memory_order_relaxed);
    m.requests.fetch_add(n_req, std::memory_order_relaxed);
    m.bytes_requested.fetch_add(bytes, std::memory_order_relaxed);
    m.bounced.fetch_add(bounced, std::memory_order_relaxed);
    m.engine->start(ops);
    return ticket;
}

void FlashReader::wait(Ticket ticket) {
    Impl & m = *impl_;
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Batch> batch;
    {
        std::unique_lock<std::mutex> lock(m.mu);
        auto it = m.batches_by_ticket.find(ticket);
        if (it == m.batches_by_ticket.end()) {
            throw std::invalid_argument("unknown read ticket " + std::to_string(ticket) +
                                        " (never submitted, or already waited for)");
        }
        Batch * b = it->second.get();
        m.cv.wait(lock, [b] { return b->complete; });
        batch = std::move(it->second);
        m.batches_by_ticket.erase(it);
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    m.wait_calls.fetch_add(1, std::memory_order_relaxed);
    m.wait_ns.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
    if (!batch->error.empty()) throw IoError(batch->error);
}

bool FlashReader::poll(Ticket ticket) const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->batches_by_ticket.find(ticket);
    if (it == impl_->batches_by_ticket.end()) {
        throw std::invalid_argument("unknown read ticket " + std::to_string(ticket));
    }
    return it->second->complete;
}

bool FlashReader::wait_request(Ticket ticket, size_t request) const {
    const Impl & m = *impl_;
    std::unique_lock<std::mutex> lock(m.mu);
    auto it = m.batches_by_ticket.find(ticket);
    if (it == m.batches_by_ticket.end()) {
        throw std::invalid_argument("unknown read ticket " + std::to_string(ticket));
    }
    Batch * b = it->second.get();
    if (request >= b->n_requests) {
        throw std::invalid_argument("read ticket " + std::to_string(ticket) + " has no request " +
                                    std::to_string(request));
    }
    m.cv.wait(lock,
              [b, request] { return b->complete || b->request_pending[request].load(std::memory_order_acquire) == 0; });
    return b->request_failed[request] == 0;
}

void FlashReader::read(const std::vector<ReadRequest> & requests) { wait(submit(requests)); }

void FlashReader::verify() const {
    const Impl & m = *impl_;
    const std::string replaced = m.replaced_note();
    struct stat st{};
    std::string what;
    if (!replaced.empty()) {
        what = replaced.substr(2);
    } else if (::fstat(m.fd, &st) != 0) {
        what = "it cannot be inspected: " + errno_text(errno);
    } else if (!S_ISBLK(st.st_mode) && static_cast<uint64_t>(st.st_size) != m.size) {
        what = "its size changed from " + std::to_string(m.size) + " to " + std::to_string(st.st_size) + " bytes";
    } else if (st.st_mtim.tv_sec != m.mtime.tv_sec || st.st_mtim.tv_nsec != m.mtime.tv_nsec) {
        what = "it was modified";
    }
    if (!what.empty()) {
        throw IoError("'" + m.path + "' changed since it was opened: " + what +
                      "; restore the file or re-create it (llamaflash convert --force), then load the model again");
    }
}

const std::string & FlashReader::path() const { return impl_->path; }
uint64_t FlashReader::file_size() const { return impl_->size; }
size_t FlashReader::alignment() const { return impl_->alignment; }
bool FlashReader::direct() const { return impl_->direct; }
const std::string & FlashReader::fallback_reason() const { return impl_->fallback_reason; }
IoEngineKind parse_io_engine(const std::string & name) {
    if (name == "auto") return IoEngineKind::Auto;
    if (name == "io_uring") return IoEngineKind::IoUring;
    if (name == "pool") return IoEngineKind::Pool;
    throw std::invalid_argument("engine must be 'auto', 'io_uring' or 'pool', got '" + name + "'");
}

const char * FlashReader::engine_name() const { return impl_->engine->name(); }
const std::string & FlashReader::engine_note() const { return impl_->engine_note; }
unsigned FlashReader::queue_depth() const { return impl_->opts.queue_depth; }

FlashReaderStats FlashReader::stats() const {
    const Impl & m = *impl_;
    FlashReaderStats s;
    s.batches = m.batches.load();
    s.requests = m.requests.load();
    s.bytes_requested = m.bytes_requested.load();
    s.reads = m.counters.reads.load();
    s.bytes_read = m.counters.bytes_read.load();
    s.bounced = m.bounced.load();
    s.resumed = m.counters.resumed.load();
    s.retried = m.counters.retried.load();
    s.errors = m.errors.load();
    s.wait_calls = m.wait_calls.load();
    s.wait_ns = m.wait_ns.load();
    s.engine = m.engine->name();
    s.direct = m.direct;
    return s;
}

void FlashReader::inject_fault_for_testing(uint64_t offset, int err) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto & f = impl_->faults;
    f.erase(std::remove_if(f.begin(), f.end(), [&](const auto & p) { return p.first == offset; }), f.end());
    if (err != 0) f.emplace_back(offset, err);
}

// ---------------------------------------------------------------------------------------------
// measure_random_reads

RandomReadResult measure_random_reads(FlashReader & reader, uint64_t request_bytes, unsigned depth, double seconds,
                                      uint64_t region_offset, uint64_t region_bytes, uint64_t seed) {
    if (request_bytes == 0 || depth == 0 || region_bytes < request_bytes) {
        throw std::invalid_argument(
            "measure_random_reads: need request_bytes > 0, depth > 0 and a region of at least one request");
    }
    const uint64_t slots_in_region = region_bytes / request_bytes;
    AlignedBuffer buffer(request_bytes * depth, std::max<size_t>(reader.alignment(), 4096));
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    auto next_offset = [&] {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        return region_offset + (state % slots_in_region) * request_bytes;
    };
    std::vector<FlashReader::Ticket> tickets(depth);
    auto issue = [&](unsigned slot) {
        ReadRequest r{next_offset(), request_bytes, buffer.data() + slot * request_bytes};
        tickets[slot] = reader.submit(&r, 1);
    };
    RandomReadResult out;
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline =
        t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
    std::vector<bool> live(depth, false);
    try {
        for (unsigned s = 0; s < depth; ++s) {
            issue(s);
            live[s] = true;
        }
        unsigned slot = 0;
        bool running = true;
        for (unsigned outstanding = depth; outstanding > 0;) {
            live[slot] = false;
            reader.wait(tickets[slot]);
            ++out.reads;
            out.bytes += request_bytes;
            if (running && std::chrono::steady_clock::now() >= deadline) running = false;
            if (running) {
                issue(slot);
                live[slot] = true;
            } else {
                --outstanding;
            }
            slot = (slot + 1) % depth;
        }
    } catch (...) {
        // `buffer` must outlive every read into it
        for (unsigned s = 0; s < depth; ++s) {
            if (!live[s]) continue;
            try {
                reader.wait(tickets[s]);
            } catch (...) {
            }
        }
        throw;
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
}

}  // namespace llamaflash
