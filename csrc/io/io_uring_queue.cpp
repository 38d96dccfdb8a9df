// io_uring_queue.cpp — the "io_uring" engine of flash_io, on raw syscalls (no liburing).
//
// One I/O thread per engine creates and alone uses the ring (so SINGLE_ISSUER/DEFER_TASKRUN apply
// and completions' task work runs on that thread, which never exits while reads are in flight).
// Other threads hand ops over through a mutex-protected queue and wake the I/O thread with an
// eventfd, on which the ring keeps a POLL_ADD armed. See io_engine.h for the engine contract.
#include "io/io_engine.h"

#include <linux/io_uring.h>

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>

namespace llamaflash {

namespace {

int sys_io_uring_setup(unsigned entries, io_uring_params * p) {
    return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}

int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return static_cast<int>(::syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

// A mapped SQ/CQ ring pair. Not thread-safe: one thread owns it.
class Ring {
public:
    // Throws IoError naming the failing step and errno.
    explicit Ring(unsigned entries) {
        // Best flags first; older kernels reject newer flags with EINVAL.
        const unsigned tries[] = {
            IORING_SETUP_CLAMP | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
            IORING_SETUP_CLAMP | IORING_SETUP_COOP_TASKRUN,
            IORING_SETUP_CLAMP,
        };
        io_uring_params p{};
        for (unsigned flags : tries) {
            std::memset(&p, 0, sizeof p);
            p.flags = flags;
            fd_ = sys_io_uring_setup(entries, &p);
            if (fd_ >= 0 || errno != EINVAL) break;
        }
        if (fd_ < 0) {
            throw IoError(std::string("io_uring_setup failed: ") + std::strerror(errno));
        }
        sq_size_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        cq_size_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
        const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
        if (single) sq_size_ = cq_size_ = std::max(sq_size_, cq_size_);
        sq_ptr_ = map(sq_size_, IORING_OFF_SQ_RING);
        cq_ptr_ = single ? sq_ptr_ : map(cq_size_, IORING_OFF_CQ_RING);
        sqes_size_ = p.sq_entries * sizeof(io_uring_sqe);
        sqes_ = static_cast<io_uring_sqe *>(map(sqes_size_, IORING_OFF_SQES));

        auto * sq = static_cast<uint8_t *>(sq_ptr_);
        sq_head_ = reinterpret_cast<unsigned *>(sq + p.sq_off.head);
        sq_tail_ = reinterpret_cast<unsigned *>(sq + p.sq_off.tail);
        sq_mask_ = *reinterpret_cast<unsigned *>(sq + p.sq_off.ring_mask);
        sq_entries_ = p.sq_entries;
        auto * sq_array = reinterpret_cast<unsigned *>(sq + p.sq_off.array);
        for (unsigned i = 0; i < sq_entries_; ++i) sq_array[i] = i;
        auto * cq = static_cast<uint8_t *>(cq_ptr_);
        cq_head_ = reinterpret_cast<unsigned *>(cq + p.cq_off.head);
        cq_tail_ = reinterpret_cast<unsigned *>(cq + p.cq_off.tail);
        cq_mask_ = *reinterpret_cast<unsigned *>(cq + p.cq_off.ring_mask);
        cqes_ = reinterpret_cast<io_uring_cqe *>(cq + p.cq_off.cqes);
        tail_ = *sq_tail_;
    }

    ~Ring() { release(); }
    Ring(const Ring &) = delete;
    Ring & operator=(const Ring &) = delete;

    unsigned entries() const { return sq_entries_; }

    // A zeroed SQE to fill, or nullptr when the SQ is full. It is submitted by the next enter().
    io_uring_sqe * get_sqe() {
        const unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
        if (tail_ - head >= sq_entries_) return nullptr;
        io_uring_sqe * sqe = &sqes_[tail_ & sq_mask_];
        std::memset(sqe, 0, sizeof *sqe);
        ++tail_;
        ++pending_;
        return sqe;
    }

    // Submits prepared SQEs and waits for at least `min_complete` completions. Returns 0 or -errno
    // (EINTR is retried here; EAGAIN/EBUSY mean "reap first").
    int enter(unsigned min_complete) {
        __atomic_store_n(sq_tail_, tail_, __ATOMIC_RELEASE);
        for (;;) {
            const unsigned flags = min_complete > 0 ? IORING_ENTER_GETEVENTS : 0;
            const int r = sys_io_uring_enter(fd_, pending_, min_complete, flags);
            if (r >= 0) {
                pending_ -= std::min<unsigned>(pending_, static_cast<unsigned>(r));
                return 0;
            }
            if (errno != EINTR) return -errno;
        }
    }

    // Calls f(user_data, res) for every available completion; returns how many.
    template <typename F>
    unsigned reap(F && f) {
        unsigned head = *cq_head_;
        const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
        unsigned n = 0;
        while (head != tail) {
            const io_uring_cqe & cqe = cqes_[head & cq_mask_];
            const uint64_t ud = cqe.user_data;
            const int32_t res = cqe.res;
            ++head;
            ++n;
            __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
            f(ud, res);
        }
        return n;
    }

private:
    void * map(size_t size, off_t what) {
        void * p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
        if (p == MAP_FAILED) {
            const int err = errno;
            release();
            throw IoError(std::string("io_uring ring mmap failed: ") + std::strerror(err));
        }
        return p;
    }

    void release() {
        if (sqes_ != nullptr) ::munmap(sqes_, sqes_size_);
        if (cq_ptr_ != nullptr && cq_ptr_ != sq_ptr_) ::munmap(cq_ptr_, cq_size_);
        if (sq_ptr_ != nullptr) ::munmap(sq_ptr_, sq_size_);
        sqes_ = nullptr;
        cq_ptr_ = sq_ptr_ = nullptr;
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

    int fd_ = -1;
    void * sq_ptr_ = nullptr;
    void * cq_ptr_ = nullptr;
    size_t sq_size_ = 0, cq_size_ = 0, sqes_size_ = 0;
    io_uring_sqe * sqes_ = nullptr;
    io_uring_cqe * cqes_ = nullptr;
    unsigned * sq_head_ = nullptr;
    unsigned * sq_tail_ = nullptr;
    unsigned * cq_head_ = nullptr;
    unsigned * cq_tail_ = nullptr;
    unsigned sq_mask_ = 0, cq_mask_ = 0, sq_entries_ = 0;
    unsigned tail_ = 0;     // local SQ tail (published in enter())
    unsigned pending_ = 0;  // prepared SQEs not yet consumed by the kernel
};

constexpr uint64_t kWakeTag = 1;  // user_data of the eventfd poll (IoOp pointers are never 1)

unsigned round_up_pow2(unsigned v) {
    unsigned p = 1;
    while (p < v) p <<= 1;
    return p;
}

class UringEngine final : public IoEngine {
public:
    explicit UringEngine(const IoEngineConfig & config) : cfg_(config) {
        wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (wake_fd_ < 0) {
            throw IoError(std::string("eventfd failed: ") + std::strerror(errno));
        }
        std::promise<std::string> ready;
        std::future<std::string> started = ready.get_future();
        thread_ = std::thread([this, &ready] { run(ready); });
        const std::string error = started.get();
        if (!error.empty()) {
            thread_.join();
            ::close(wake_fd_);
            throw IoError(error);
        }
    }

    ~UringEngine() override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        wake();
        thread_.join();
        ::close(wake_fd_);
    }

    const char * name() const override { return "io_uring"; }

    void start(const std::vector<IoOp *> & ops) override {
        if (ops.empty()) return;
        bool was_empty;
        {
            std::lock_guard<std::mutex> lock(mu_);
            was_empty = incoming_.empty();
            incoming_.insert(incoming_.end(), ops.begin(), ops.end());
        }
        // The I/O thread empties `incoming_` completely after every wake-up, so only the
        // empty -> non-empty transition needs a wake-up.
        if (was_empty) wake();
    }

private:
    void wake() {
        const uint64_t one = 1;
        while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
        }
    }

    bool arm_wake(Ring & ring) {
        io_uring_sqe * sqe = ring.get_sqe();
        if (sqe == nullptr) return false;
        sqe->opcode = IORING_OP_POLL_ADD;
        sqe->fd = wake_fd_;
        sqe->poll32_events = POLLIN;
        sqe->user_data = kWakeTag;
        return true;
    }

    void finish(IoOp * op, int64_t res, std::deque<IoOp *> & backlog) {
        if (op_result(*op, res, cfg_.direct, cfg_.alignment, *cfg_.counters) == OpNext::Again) {
            backlog.push_front(op);
        } else {
            cfg_.complete(op);
        }
    }

    void fail_all(std::deque<IoOp *> & ops, int err) {
        for (IoOp * op : ops) {
            op->error = err;
            cfg_.complete(op);
        }
        ops.clear();
    }

    void run(std::promise<std::string> & ready) {
        std::unique_ptr<Ring> ring_holder;
        try {
            // queue_depth reads + the wake-up poll always fit in the SQ; the CQ is twice as large.
            ring_holder = std::make_unique<Ring>(round_up_pow2(cfg_.queue_depth + 1));
            if (ring_holder->entries() < cfg_.queue_depth + 1) {
                throw IoError("io_uring ring too small for queue depth " + std::to_string(cfg_.queue_depth));
            }
        } catch (const std::exception & e) {
            ready.set_value(e.what());
            return;
        }
        Ring & ring = *ring_holder;
        arm_wake(ring);
        ready.set_value(std::string());

        std::deque<IoOp *> backlog;  // accepted, not yet in the kernel (FIFO; resumptions first)
        unsigned in_flight = 0;
        bool wake_armed = true;
        for (;;) {
            bool stopping;
            {
                std::lock_guard<std::mutex> lock(mu_);
                backlog.insert(backlog.end(), incoming_.begin(), incoming_.end());
                incoming_.clear();
                stopping = stop_;
            }
            if (stopping) {
                fail_all(backlog, ECANCELED);
                if (in_flight == 0) break;
            }
            if (!wake_armed) wake_armed = arm_wake(ring);
            std::vector<IoOp *> prepared;
            while (!backlog.empty() && in_flight + prepared.size() < cfg_.queue_depth) {
                IoOp * op = backlog.front();
                if (op->inject_errno != 0) {
                    backlog.pop_front();
                    cfg_.counters->reads.fetch_add(1, std::memory_order_relaxed);
                    finish(op, -static_cast<int64_t>(op->inject_errno), backlog);
                    continue;
                }
                io_uring_sqe * sqe = ring.get_sqe();
                if (sqe == nullptr) break;
                backlog.pop_front();
                sqe->opcode = IORING_OP_READ;
                sqe->fd = cfg_.fd;
                sqe->off = op->offset + op->done;
                sqe->addr = reinterpret_cast<uint64_t>(op->buf + op->done);
                sqe->len = static_cast<uint32_t>(op->length - op->done);
                sqe->user_data = reinterpret_cast<uint64_t>(op);
                prepared.push_back(op);
            }
            in_flight += static_cast<unsigned>(prepared.size());
            cfg_.counters->reads.fetch_add(prepared.size(), std::memory_order_relaxed);

            const int r = ring.enter(1);
            if (r < 0 && r != -EAGAIN && r != -EBUSY) {
                // The ring itself is broken (never seen in practice): fail what waits, keep reaping
                // what the kernel has, and avoid a busy loop.
                fail_all(backlog, -r);
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            ring.reap([&](uint64_t ud, int32_t res) {
                if (ud == kWakeTag) {
                    uint64_t v;
                    while (::read(wake_fd_, &v, sizeof v) < 0 && errno == EINTR) {
                    }
                    wake_armed = arm_wake(ring);
                    return;
                }
                --in_flight;
                finish(reinterpret_cast<IoOp *>(ud), res, backlog);
            });
        }
        // Destroying the ring cancels the armed poll; no read is in flight.
    }

    IoEngineConfig cfg_;
    int wake_fd_ = -1;
    std::mutex mu_;
    std::vector<IoOp *> incoming_;
    bool stop_ = false;
    std::thread thread_;
};

}  // namespace

std::unique_ptr<IoEngine> make_io_uring_engine(const IoEngineConfig & config) {
    std::string why;
    if (!io_uring_available(&why)) {
        throw IoError("io_uring is not available: " + why);
    }
    return std::make_unique<UringEngine>(config);
}

bool io_uring_available(std::string * why) {
    std::ifstream f("/proc/sys/kernel/io_uring_disabled");
    int disabled = 0;
    if (f >> disabled && disabled == 2) {
        if (why) *why = "disabled by the kernel (/proc/sys/kernel/io_uring_disabled = 2)";
        return false;
    }
    io_uring_params p{};
    const int fd = sys_io_uring_setup(2, &p);
    if (fd < 0) {
        const int err = errno;
        if (why) {
            *why = std::string("io_uring_setup: ") + std::strerror(err);
            if (err == EPERM && disabled == 1) {
                *why += " (/proc/sys/kernel/io_uring_disabled = 1: only members of kernel.io_uring_group)";
            } else if (err == ENOSYS) {
                *why += " (kernel built without io_uring, or blocked by seccomp)";
            }
        }
        return false;
    }
    ::close(fd);
    return true;
}

}  // namespace llamaflash
