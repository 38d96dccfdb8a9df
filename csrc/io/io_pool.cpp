// io_pool.cpp — the "pool" engine of flash_io: queue_depth threads, each issuing blocking pread()s.
// Works on every kernel and filesystem; see io_engine.h for the engine contract.
#include "io/io_engine.h"

#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace llamaflash {

namespace {

// More threads than this only add context switches: the kernel queues what they submit anyway.
constexpr unsigned kMaxPoolThreads = 128;

class PoolEngine final : public IoEngine {
public:
    explicit PoolEngine(const IoEngineConfig & config) : cfg_(config) {
        const unsigned n = std::min(std::max(cfg_.queue_depth, 1u), kMaxPoolThreads);
        workers_.reserve(n);
        for (unsigned i = 0; i < n; ++i) {
            workers_.emplace_back([this] { work(); });
        }
    }

    ~PoolEngine() override {
        std::deque<IoOp *> cancelled;
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
            cancelled.swap(queue_);
        }
        cv_.notify_all();
        for (IoOp * op : cancelled) {
            op->error = ECANCELED;
            cfg_.complete(op);
        }
        for (auto & t : workers_) {
            t.join();
        }
    }

    const char * name() const override { return "pool"; }

    void start(const std::vector<IoOp *> & ops) override {
        if (ops.empty()) return;
        {
            std::lock_guard<std::mutex> lock(mu_);
            queue_.insert(queue_.end(), ops.begin(), ops.end());
        }
        if (ops.size() == 1) {
            cv_.notify_one();
        } else {
            cv_.notify_all();
        }
    }

private:
    void work() {
        for (;;) {
            IoOp * op = nullptr;
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
                if (stop_) return;  // the destructor owns (and cancels) what is still queued
                op = queue_.front();
                queue_.pop_front();
            }
            run(*op);
            cfg_.complete(op);
        }
    }

    void run(IoOp & op) const {
        for (;;) {
            int64_t res;
            cfg_.counters->reads.fetch_add(1, std::memory_order_relaxed);
            if (op.inject_errno != 0) {
                res = -static_cast<int64_t>(op.inject_errno);
            } else {
                const ssize_t r =
                    ::pread(cfg_.fd, op.buf + op.done, op.length - op.done, static_cast<off_t>(op.offset + op.done));
                res = r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r);
            }
            if (op_result(op, res, cfg_.direct, cfg_.alignment, *cfg_.counters) == OpNext::Done) {
                return;
            }
            if (res == -EAGAIN) {
                std::this_thread::sleep_for(std::chrono::microseconds(200));
            }
        }
    }

    IoEngineConfig cfg_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<IoOp *> queue_;
    bool stop_ = false;
    std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoEngine> make_pool_engine(const IoEngineConfig & config) {
    return std::make_unique<PoolEngine>(config);
}

}  // namespace llamaflash
