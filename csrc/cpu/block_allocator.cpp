// The CPU allocator attnkit puts in c10's place while an instrumented model runs a CPU forward
// (attnkit/ops.py, hold_cpu_allocator; docs/decoders.md §7, "Memory: what glibc keeps").
//
// Why: c10's default CPU allocator takes every tensor from posix_memalign(64, n). glibc serves an aligned request
// from a free chunk of n + 64 + 32 bytes and cuts the slack off, so the hole a freed n-byte activation leaves is too
// small for the next activation of the same n unless a free neighbour happens to merge with it. Whether one does
// depends on the order in which the threads freed their buffers: SmolLM2's forward at 8k tokens then grew glibc's
// heap to 183 MB in some runs and to 440 MB in others (sdpa's forward as well as attnkit's). Here every block is a
// plain malloc(n + 64), aligned by hand inside it: a freed block is exactly the size the next request of that size
// asks for, and the heap stays at the low figure run after run.
//
// Each block keeps the pointer malloc returned in the 8 bytes before the aligned data, so data == context (c10's
// raw_allocate and copy-on-write take such pointers), and one deleter frees every block, also after the allocator
// was taken out again. Allocations are reported to c10's memory profiler as the default allocator reports them.
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/util/Exception.h>
#include <c10/util/numa.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>

namespace attnkit::cpu {
namespace {

constexpr size_t kAlign = c10::gAlignment;  // what c10's own allocator guarantees (64 bytes on x86-64)
static_assert(kAlign >= 2 * sizeof(void*) && (kAlign & (kAlign - 1)) == 0);

void free_block(void* data) {
  if (data == nullptr) return;
  c10::profiledCPUMemoryReporter().Delete(data);
  std::free(static_cast<void**>(data)[-1]);
}

struct BlockAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &free_block, cpu};
    TORCH_CHECK(static_cast<ptrdiff_t>(n) >= 0 && n <= SIZE_MAX - kAlign,
                "attnkit's CPU allocator was asked for ", n, " bytes");
    // malloc's pointers are 16-aligned, so rounding raw + 1 up to kAlign leaves 16..kAlign bytes before the data:
    // room for the raw pointer
    void* raw = std::malloc(n + kAlign);
    if (raw == nullptr) {
      c10::profiledCPUMemoryReporter().OutOfMemory(n);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "attnkit's CPU allocator: not enough memory: you tried to allocate ",
                       n, " bytes.");
    }
    auto* data = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(raw) + kAlign) & ~uintptr_t(kAlign - 1));
    static_cast<void**>(data)[-1] = raw;
    c10::profiledCPUMemoryReporter().New(data, n);
    return {data, data, &free_block, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

BlockAllocator block_allocator;
std::mutex holders_mutex;
int64_t holders = 0;
c10::Allocator* replaced = nullptr;  // what c10 handed out before the first holder

}  // namespace

// Puts the block allocator in c10's place for CPU tensors, counted: the first holder installs it, the last
// release restores what was there. False (and nothing to release) where it stays out: c10's NUMA placement or
// transparent-huge-page allocation is on (the default allocator does those), or another allocator was registered
// with a higher priority than c10's default.
bool hold_cpu_allocator() {
  std::lock_guard<std::mutex> lock(holders_mutex);
  if (holders == 0) {
    const char* thp = std::getenv("THP_MEM_ALLOC_ENABLE");
    if (c10::IsNUMAEnabled() || (thp != nullptr && thp[0] != '\0' && thp[0] != '0')) return false;
    c10::Allocator* current = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&block_allocator, /*priority=*/0);  // refused when a higher priority holds the slot
    if (c10::GetCPUAllocator() != &block_allocator) return false;
    replaced = current;
  }
  ++holders;
  return true;
}

void release_cpu_allocator() {
  std::lock_guard<std::mutex> lock(holders_mutex);
  TORCH_CHECK(holders > 0, "release_cpu_allocator without a hold_cpu_allocator that returned true");
  if (--holders == 0) {
    if (c10::GetCPUAllocator() == &block_allocator) c10::SetCPUAllocator(replaced, /*priority=*/0);
    replaced = nullptr;
  }
}

int64_t cpu_allocator_holders() {
  std::lock_guard<std::mutex> lock(holders_mutex);
  return holders;
}

}  // namespace attnkit::cpu
