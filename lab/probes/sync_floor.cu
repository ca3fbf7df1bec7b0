// The floor under the GEMV chain's dependencies (lab/probes/sync_floor.py; lab/pages/sync-floor.md): how long one
// flagged word takes from one SM to another, and how long every block takes to see every other block's words,
// idle and with the other warps of every block streaming a buffer larger than L2 from memory.
//
// One block per SM, 512 threads: warps 0-7 wait (as the chain's consumer warps do), warps 8-15 stream (when asked;
// 16-byte non-coherent loads that skip L1, eight in flight per thread) until block 0 has finished its rounds. Every
// block must be resident at once (the waits spin): the launch refuses a grid larger than the GPU holds.
//   mode 0, ping-pong: block 0 writes word 0 = r, block grid-1 waits for it and writes word 32 = r, block 0 waits
//     for that: one round trip per round.
//   mode 1, all-gather: every block writes its 32 words (one 128-byte line) = r, then its 256 waiting threads poll
//     all grid x 32 words (16-byte loads, as the chain's input) until every one reads r or more: one product's
//     dependency per round, without the product.
//   mode 2, counter: every block writes its line, then thread 0 adds 1 to one counter (release) and polls it
//     (acquire) until all blocks have, then the 256 threads load every line once (a grid barrier, then the input);
//     a word found older than r counts in out[2].
// Words are (round << 16) | data, written with st.relaxed.gpu and polled with ld.relaxed.gpu, as in
// lab/kernels/gemv_chain_cuda.cu. Block 0's thread 0 reads %globaltimer (ns) before the first round and after
// the last.
#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int WAITERS = 256;
constexpr int THREADS = 512;
constexpr int LINE = 32;               // words a block writes per round

__device__ __forceinline__ void store_word(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_word(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 load_words4(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void waiters_sync() { asm volatile("bar.sync 1, %0;" :: "n"(WAITERS) : "memory"); }

__global__ void __launch_bounds__(THREADS, 1)
floor_kernel(uint32_t* words, uint32_t* stop, int mode, int rounds, const uint4* stream, uint64_t stream_mask,
             unsigned long long* out) {
  const int tid = threadIdx.x, grid = gridDim.x, b = blockIdx.x;
  if (tid >= WAITERS) {                                   // the stream
    if (stream == nullptr) return;
    const int t = tid - WAITERS;
    const uint64_t threads = static_cast<uint64_t>(grid) * (THREADS - WAITERS);   // coalesced: thread i, i + threads, ...
    uint64_t i = static_cast<uint64_t>(b) * (THREADS - WAITERS) + t;
    const uint64_t step = threads * 8;
    uint32_t acc = 0;
    unsigned long long loaded = 0;
    for (int it = 0;; ++it) {
      uint4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint4* p = stream + ((i + j * threads) & stream_mask);
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w) : "l"(p));
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
      loaded += 8 * sizeof(uint4);
      i += step;
      if ((it & 7) == 7) {
        uint32_t s = (t & 31) == 0 ? load_word(stop) : 0;
        if (__shfl_sync(0xffffffffu, s, 0)) break;
      }
    }
    if (acc == 0x9e3779b9u) out[3] = acc;                 // keeps the loads
    atomicAdd(out + 1, loaded);
    return;
  }
  uint64_t start = 0;
  if (b == 0 && tid == 0) start = now_ns();
  if (mode == 0) {
    const int peer = grid - 1;
    if ((b == 0 || b == peer) && tid == 0) {
      for (uint32_t r = 1; r <= static_cast<uint32_t>(rounds); ++r) {
        if (b == 0) {
          store_word(words, r << 16);
          while ((load_word(words + LINE) >> 16) < r) {}
        } else {
          while ((load_word(words) >> 16) < r) {}
          store_word(words + LINE, r << 16);
        }
      }
    }
  } else if (mode == 2) {
    const int vecs = grid * LINE / 4;
    uint32_t* counter = stop + 32;
    unsigned long long stale = 0;
    for (uint32_t r = 1; r <= static_cast<uint32_t>(rounds); ++r) {
      if (tid < LINE) store_word(words + b * LINE + tid, (r << 16) | tid);
      waiters_sync();
      if (tid == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
        uint32_t seen;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        } while (seen < r * grid);
      }
      waiters_sync();
      for (int v = tid; v < vecs; v += WAITERS) {
        const uint4 w = load_words4(words + 4 * v);
        stale += (w.x >> 16) < r || (w.y >> 16) < r || (w.z >> 16) < r || (w.w >> 16) < r;
      }
    }
    if (stale) atomicAdd(out + 2, stale);
  } else {
    const int vecs = grid * LINE / 4;
    for (uint32_t r = 1; r <= static_cast<uint32_t>(rounds); ++r) {
      if (tid < LINE) store_word(words + b * LINE + tid, (r << 16) | tid);
      for (int v = tid; v < vecs; v += WAITERS) {
        for (;;) {
          const uint4 w = load_words4(words + 4 * v);
          if ((w.x >> 16) >= r && (w.y >> 16) >= r && (w.z >> 16) >= r && (w.w >> 16) >= r) break;
        }
      }
      waiters_sync();
    }
  }
  if (b == 0 && tid == 0) {
    out[0] = now_ns() - start;
    store_word(stop, 1);
  }
}

}  // namespace

extern "C" int minirt_sync_floor(int mode, int grid, int rounds, void* words, void* stop, const void* stream,
                                 unsigned long long stream_vecs, void* out, void* cuda_stream) {
  const uint64_t mask = stream_vecs ? stream_vecs - 1 : 0;
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, floor_kernel, THREADS, 0);
  if (grid > sms * per_sm || rounds < 1 || rounds > 65535) return -1;   // not all resident, or rounds past 16 bits
  floor_kernel<<<grid, THREADS, 0, static_cast<cudaStream_t>(cuda_stream)>>>(
      static_cast<uint32_t*>(words), static_cast<uint32_t*>(stop), mode, rounds,
      static_cast<const uint4*>(stream), mask, static_cast<unsigned long long*>(out));
  return static_cast<int>(cudaGetLastError());
}
