// attnkit's CPU allocator: the blocks of the tensors that attnkit's own measuring forwards allocate on the CPU
// (attnkit/process.py, cpu_allocator; docs/process.md; docs/decoders.md §7, "Memory: what glibc keeps").
//
// Why: c10's default CPU allocator takes every tensor from posix_memalign(64, n). glibc serves an aligned request
// from a free chunk of n + 64 + 32 bytes and cuts the slack off, so the hole a freed n-byte activation leaves is too
// small for the next activation of the same n unless a free neighbour happens to merge with it. Whether one does
// depends on the order in which the threads freed their buffers, so the peak of glibc's heap over a long decoder
// forward differed from run to run (docs/process.md has the figures). Here every block is a plain malloc(n + 64),
// aligned by hand inside it: a freed block is exactly the size the next request of that size asks for.
//
// How it is put in place without racing: c10 keeps one allocator pointer per device type, read by every thread
// that allocates, with no lock. Swapping it while another thread (a DataLoader's, the user's own) allocates is a
// data race. So c10's slot is written once, on the first hold, with a routing allocator that stays registered for
// the rest of the process: each allocation asks whether the calling thread holds attnkit's allocator (a
// thread-local count, which only attnkit's measuring forwards raise) and takes a block if so, else forwards the
// request, unchanged, to the allocator that was registered before (c10's). Every other thread, and the calling
// thread outside attnkit's forwards, allocates exactly as without attnkit.
//
// Each block keeps the pointer malloc returned in the 8 bytes before the aligned data, so data == context (c10's
// raw_allocate and copy-on-write take such pointers), and its deleter frees it wherever and whenever it is freed.
// c10's raw_deallocate asks the allocator for one deleter of every pointer, so blocks are also kept in a set that
// the raw deleter consults. Allocations are reported to c10's memory profiler as the default allocator reports them.
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/util/Exception.h>
#include <c10/util/numa.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_set>

namespace attnkit::cpu {
namespace {

constexpr size_t kAlign = c10::gAlignment;  // what c10's own allocator guarantees (64 bytes on x86-64)
static_assert(kAlign >= 2 * sizeof(void*) && (kAlign & (kAlign - 1)) == 0);

std::mutex blocks_mutex;
std::unordered_set<void*>& blocks() {  // every live block, for the raw deleter (never destroyed: freed at exit)
  static auto* set = new std::unordered_set<void*>();
  return *set;
}

void free_block(void* data) {
  if (data == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    blocks().erase(data);
  }
  c10::profiledCPUMemoryReporter().Delete(data);
  std::free(static_cast<void**>(data)[-1]);
}

c10::DataPtr allocate_block(size_t n) {
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
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    blocks().insert(data);
  }
  c10::profiledCPUMemoryReporter().New(data, n);
  return {data, data, &free_block, cpu};
}

thread_local int64_t thread_holds = 0;  // this thread's holds: its allocations are blocks while > 0
std::atomic<int64_t> holders{0};        // all threads' holds
std::atomic<c10::Allocator*> inner{nullptr};  // what c10 handed out before the routing allocator was registered

void raw_free(void* data) {
  bool block;
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    block = blocks().count(data) > 0;
  }
  if (block) {
    free_block(data);
    return;
  }
  c10::DeleterFnPtr d = inner.load()->raw_deleter();
  TORCH_CHECK(d != nullptr, "attnkit's CPU allocator: the allocator it forwards to has no raw deleter");
  d(data);
}

struct RoutingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    return thread_holds > 0 ? allocate_block(n) : inner.load(std::memory_order_acquire)->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RoutingAllocator routing;
std::mutex install_mutex;
bool install_tried = false;

// Registers the routing allocator in c10's slot, once per process. False where it stays out: c10's NUMA placement
// or transparent-huge-page allocation is on (the default allocator does those, blocks would not), or another
// allocator holds the slot with a higher priority than c10's default.
bool installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (!install_tried) {
    install_tried = true;
    const char* thp = std::getenv("THP_MEM_ALLOC_ENABLE");
    if (!c10::IsNUMAEnabled() && !(thp != nullptr && thp[0] != '\0' && thp[0] != '0')) {
      c10::Allocator* current = c10::GetCPUAllocator();
      inner.store(current, std::memory_order_release);  // before any thread can reach `routing`
      c10::SetCPUAllocator(&routing, /*priority=*/0);  // refused when a higher priority holds the slot
    }
  }
  return c10::GetCPUAllocator() == &routing;
}

}  // namespace

// The calling thread's CPU allocations become blocks until the matching release (holds are counted per thread).
// False, and nothing to release, where the routing allocator is not in c10's slot (installed(): why).
bool hold_cpu_allocator() {
  if (!installed()) return false;
  ++thread_holds;
  holders.fetch_add(1);
  return true;
}

void release_cpu_allocator() {
  TORCH_CHECK(thread_holds > 0,
              "release_cpu_allocator without a hold_cpu_allocator that returned true on this thread");
  --thread_holds;
  holders.fetch_sub(1);
}

int64_t cpu_allocator_holders() { return holders.load(); }

bool cpu_allocator_registered() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return install_tried && c10::GetCPUAllocator() == &routing;
}

}  // namespace attnkit::cpu
