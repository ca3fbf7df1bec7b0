// The layers' GEMV chain at batch 1 in one persistent CUDA kernel with its weights streamed through shared memory
// (issue 23's megakernel, second step; minirt/kernels/gemv_chain_cuda.py builds it with nvcc, checks the
// arguments and launches it through ctypes).
//
// One thread block per SM, for the whole launch (every layer). Each block owns a contiguous range of output rows
// in each of a layer's four products, so it knows from the start every weight byte it will read, in order:
//   - a producer warp streams them, tile after tile, layer after layer, into a ring of shared-memory stages with
//     the bulk-copy engine (`cp.async.bulk`, completing on an mbarrier per stage); it waits only for a free stage,
//     never for activations, so the memory keeps streaming while the other warps wait for the rest of the grid;
//   - eight consumer warps wait for the previous product's output (a grid barrier on an atomic count, or a flag
//     per block), read it from L2 into shared memory (with the norm's prologue), then take the stages as they
//     fill: each warp one row (or a share of one row's columns), a dot product of 16-byte loads in independent
//     chains, each lane's sum kept in shared memory; the epilogue adds a row's lane sums in a fixed order (the same
//     bits on every run) and writes the row.
// The scheme is Hazy Research's Llama-1B "megakernel" (2025: weights loaded ahead through a shared-memory pipeline
// while instructions wait on counters) and the warp-specialized producer/consumer pipelines of CUTLASS's Hopper
// kernels, cut down to this chain.
//
//   per layer l:  qkv, s1 = gemv(x, W_qkv, norm g1, residual s0)     s0: the previous layer's s2 (layer 0: given)
//                 o       = gemv(qkv[:K_o], W_o)
//                 act, s2 = gemv(o, W_gate_up, norm g2, residual s1, silu_and_mul)
//                 x       = gemv(act, W_down)
// with `linear_gemv`'s arithmetic: the stream rounded to bf16, the norm applied as rstd * dot(w, g * s), gate and
// up rounded to bf16 before silu(gate) * up, float32 accumulation; only the order of the sums differs.

#include <cuda_bf16.h>
#include <cstdint>

namespace minirt_chain {

constexpr int CONSUMER_WARPS = 8;
constexpr int CONSUMERS = CONSUMER_WARPS * 32;
constexpr int THREADS = CONSUMERS + 32;          // + the producer warp
#ifndef MINIRT_STAGE_BYTES
#define MINIRT_STAGE_BYTES 16384
#endif
constexpr int STAGE_BYTES = MINIRT_STAGE_BYTES;  // one ring stage (gemv_chain_cuda.py builds a library per size)
constexpr int MAX_STEPS = 4;                     // a warp's share of a row: at most 4 x 256 columns
constexpr int MAX_TILES = 16;                    // stage tiles per block per product (the lane sums' buffer)
constexpr int MAX_X_VECS = 4;                    // a product's input: at most 4 x 8 x CONSUMERS columns
// Params::flags, for benchmarks/gemv.py's breakdown of the time (each leaves a part out; results are then wrong)
constexpr int SKIP_BARRIERS = 1, SKIP_PROLOGUE = 2, SKIP_DOTS = 4, SKIP_STREAM = 8;
// ... and how blocks wait for each other: a grid barrier on one count (0), with a pause between polls (BACKOFF), or
// per-block flags (SYNC_FLAGS): each block publishes the products it finished, and each thread waits only for the
// blocks that wrote the input columns it loads (every block writes rows of every product, so a block's threads
// together still wait for all blocks: each phase waits for the whole previous one, as with the barrier).
constexpr int SYNC_FLAGS = 16, BACKOFF = 32;
constexpr int FLAG_STRIDE = 32;                  // a block's flag every 128 bytes, after the count
// Params::timeline: per block and product, the SM's clock when thread 0 starts the product, is through the grid
// barrier (SYNC_FLAGS: the flags are waited for with the input), through its input, has its first stage, is through
// its stages, through its epilogue; when the producer issues the product's first and last copy (unset where it
// streams no rows of the product; gemv_chain_cuda.py's TIMELINE_STAMPS names them).
constexpr int STAMPS = 8;

struct Params {
  const long long* layers;   // [num_layers][6] addresses: W_qkv, W_o, W_gate_up, W_down, g1, g2
  int num_layers;
  const __nv_bfloat16* x;         // [hidden]
  const __nv_bfloat16* residual;  // [hidden] or nullptr
  __nv_bfloat16* qkv;             // [n_qkv]
  __nv_bfloat16* o;               // [hidden]
  __nv_bfloat16* act;             // [inter]
  __nv_bfloat16* out;             // [hidden]: each layer's output, the next one's x
  __nv_bfloat16* s1;              // [hidden]: the last layer's streams (block 0 writes them)
  __nv_bfloat16* s2;
  unsigned* counter;              // zero at launch: the count, then (SYNC_FLAGS) a flag per block
  int hidden, n_qkv, k_o, inter;
  int rows[4];                    // output rows per stage tile, per product (gate/up: pairs)
  int num_stages;
  float eps;
  int flags;                      // 0, or SKIP_* bits (timing breakdowns only)
  long long* timeline;            // nullptr, or [grid][num_layers * 4][STAMPS] SM clock readings (benchmarks only)
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void consumer_sync() {      // named barrier 1: the consumer warps only
  asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory");
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Every block's consumers: arrive, then wait until `target` arrivals (the k-th barrier of the launch: k x grid).
// As CUTLASS's generic barrier (cutlass/barrier.h): the block barrier orders the block's stores before thread 0's
// fence and relaxed add; the acquire load orders the others' stores before what the block reads next (through L2:
// __ldcg).
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void wait_at_least(const unsigned* p, unsigned target, bool backoff) {
  while (load_acquire(p) < target)
    if (backoff) __nanosleep(32);
}
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target, bool backoff) {
  consumer_sync();
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
    wait_at_least(counter, target, backoff);
  }
  consumer_sync();
}
// SYNC_FLAGS: after its epilogue's stores, the block publishes `epoch` (the count of products it has finished).
__device__ __forceinline__ void publish(unsigned* flag, unsigned epoch) {
  consumer_sync();
  if (threadIdx.x == 0)
    asm volatile("fence.acq_rel.gpu;\nst.relaxed.gpu.global.u32 [%0], %1;" :: "l"(flag), "r"(epoch) : "memory");
}
// The block that owns output row j of an n-row product (the inverse of block_rows' split).
__device__ __forceinline__ int row_owner(int j, int n) {
  return static_cast<int>(((static_cast<long long>(j) + 1) * gridDim.x + n - 1) / n) - 1;
}

// Output rows [lo, hi) of product p owned by this block: an even split of n rows over the grid.
// (32-bit: the Python side keeps n x grid below 2**32.)
__device__ __forceinline__ void block_rows(int n, int& lo, int& hi) {
  lo = static_cast<int>(static_cast<unsigned>(n) * blockIdx.x / gridDim.x);
  hi = static_cast<int>(static_cast<unsigned>(n) * (blockIdx.x + 1) / gridDim.x);
}
static_assert(16 == MAX_TILES && 8 == CONSUMER_WARPS, "LANE_STRIDE below");
// A row's sum: its wpr warps' 32 lane sums each (lane-major in shared memory, so that the threads summing
// neighbouring rows read neighbouring words: no bank conflicts), in a fixed order, four chains.
constexpr int LANE_STRIDE = 16 * 8;              // MAX_TILES x CONSUMER_WARPS
__device__ __forceinline__ float row_sum(const float* warps, int wpr) {
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q = 0; q < wpr; ++q) {
#pragma unroll
    for (int lane = 0; lane < 32; ++lane) c[lane % 4] += warps[lane * LANE_STRIDE + q];
  }
  return (c[0] + c[1]) + (c[2] + c[3]);
}

// Product p's output rows, input columns and output rows per stage tile (selects, not an indexed array: a run-time
// index into the parameters would copy them to local memory).
__device__ __forceinline__ int n_out(const Params& P, int p) {
  return p == 0 ? P.n_qkv : p == 2 ? P.inter : P.hidden;
}
__device__ __forceinline__ int k_in(const Params& P, int p) {
  return p == 1 ? P.k_o : p == 3 ? P.inter : P.hidden;
}
__device__ __forceinline__ int tile_rows(const Params& P, int p) {
  return p == 0 ? P.rows[0] : p == 1 ? P.rows[1] : p == 2 ? P.rows[2] : P.rows[3];
}

__device__ __forceinline__ void stamp(const Params& P, int product, int slot) {
  if (P.timeline != nullptr)
    P.timeline[(static_cast<long long>(blockIdx.x) * P.num_layers * 4 + product) * STAMPS + slot] = clock64();
}

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

__global__ void __launch_bounds__(THREADS, 1) gemv_chain_kernel(const Params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int S = P.num_stages;
  unsigned char* ring = smem;                                                   // S x STAGE_BYTES
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + S * STAGE_BYTES);         // S
  uint64_t* empty = full + S;                                                   // S
  float* xs = reinterpret_cast<float*>(empty + S);           // [max K]: this product's input, norm weight applied
  float* stream = xs + max(P.inter, max(P.k_o, P.hidden));   // [hidden]: the residual stream, exact bf16 values
  float* red = stream + P.hidden;          // [MAX_TILES][CONSUMER_WARPS][32] lane sums, then [CONSUMER_WARPS] sumsq

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == CONSUMER_WARPS) {                   // the producer: every weight tile of the launch, in order
    if (lane == 0 && !(P.flags & SKIP_STREAM)) {
      uint32_t it = 0;
      for (int l = 0; l < P.num_layers; ++l) {
        for (int p = 0; p < 4; ++p) {
          const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(P.layers[l * 6 + p]);
          const int k = k_in(P, p), r = tile_rows(P, p);
          int lo, hi;
          block_rows(n_out(P, p), lo, hi);
          for (int r0 = lo; r0 < hi; r0 += r, ++it) {
            const int s = it % S;
            mbar_wait(&empty[s], ((it / S) & 1) ^ 1);    // a fresh barrier passes parity 1 at once
            if (r0 == lo) stamp(P, l * 4 + p, 6);
            if (r0 + r >= hi) stamp(P, l * 4 + p, 7);
            const uint32_t bytes = static_cast<uint32_t>(min(r, hi - r0) * k) * 2u;
            unsigned char* stage = ring + s * STAGE_BYTES;
            mbar_arrive_expect_tx(&full[s], p == 2 ? 2 * bytes : bytes);
            bulk_load(stage, w + static_cast<long long>(r0) * k, bytes, &full[s]);
            if (p == 2)   // the up rows of the same outputs, r rows further in the stage
              bulk_load(stage + r * k * 2, w + static_cast<long long>(P.inter + r0) * k, bytes, &full[s]);
          }
        }
      }
    }
    return;
  }

  const int tid = threadIdx.x;
  float* sumsq = red + MAX_TILES * CONSUMER_WARPS * 32;
  uint32_t it = 0;
  for (int l = 0; l < P.num_layers; ++l) {
    const long long* lw = P.layers + l * 6;
    for (int p = 0; p < 4; ++p) {
      const bool flags = P.flags & SYNC_FLAGS, backoff = P.flags & BACKOFF;
      const unsigned epoch = l * 4 + p;                    // products finished before this one
      if (tid == 0) stamp(P, epoch, 0);
      if ((l > 0 || p > 0) && !(P.flags & SKIP_BARRIERS) && !flags)
        grid_barrier(P.counter, epoch * gridDim.x, backoff);
      if (tid == 0) stamp(P, epoch, 1);
      const int k = k_in(P, p);
      // Prologue: this product's input x into xs (the norm's weight applied, the stream updated). Every load
      // of a thread is issued before the first is used: one round trip to L2.
      float sq = 0.f;
      if (!(P.flags & SKIP_PROLOGUE)) {
        const bool norm = p == 0 || p == 2;
        const bool first = l == 0 && p == 0;           // the caller's x and residual: not written in this launch
        const __nv_bfloat16* x = p == 0 ? (first ? P.x : P.out) : p == 1 ? P.qkv : p == 2 ? P.o : P.act;
        const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(lw[p == 0 ? 4 : 5]);
        uint4 xv[MAX_X_VECS], gv[MAX_X_VECS], rv[MAX_X_VECS];
        if (flags && !first && !(P.flags & SKIP_BARRIERS)) {   // the writers of this thread's columns, done?
          const int n_prev = p == 0 ? P.hidden : p == 1 ? P.n_qkv : p == 2 ? P.hidden : P.inter;
#pragma unroll
          for (int i = 0; i < MAX_X_VECS; ++i) {
            const int c = (tid + i * CONSUMERS) * 8;
            if (c < k) {
              const int b0 = row_owner(c, n_prev), b1 = row_owner(c + 7, n_prev);
              for (int b = b0; b <= b1; ++b) wait_at_least(P.counter + FLAG_STRIDE * (b + 1), epoch, backoff);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < MAX_X_VECS; ++i) {
          const int c = (tid + i * CONSUMERS) * 8;
          if (c < k) {
            const uint4* src = reinterpret_cast<const uint4*>(x + c);
            xv[i] = first ? *src : __ldcg(src);
            if (norm) gv[i] = *reinterpret_cast<const uint4*>(g + c);
            if (first && P.residual != nullptr) rv[i] = *reinterpret_cast<const uint4*>(P.residual + c);
          }
        }
#pragma unroll
        for (int i = 0; i < MAX_X_VECS; ++i) {
          const int c = (tid + i * CONSUMERS) * 8;
          if (c >= k) continue;
          const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv[i]);
          float v[8];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(x2[e]);
            v[2 * e] = f.x;
            v[2 * e + 1] = f.y;
          }
          if (!norm) {
#pragma unroll
            for (int e = 0; e < 8; ++e) xs[c + e] = v[e];
            continue;
          }
          const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv[i]);
          const __nv_bfloat162* r2 = reinterpret_cast<const __nv_bfloat162*>(&rv[i]);
          __nv_bfloat162 kept[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 gf = __bfloat1622float2(g2[e]);
            float a = v[2 * e], b = v[2 * e + 1];
            if (!first) {                      // the stream: the layer before's s2 (p = 0) or this layer's s1
              a = bf(a + stream[c + 2 * e]);
              b = bf(b + stream[c + 2 * e + 1]);
            } else if (P.residual != nullptr) {
              const float2 rf = __bfloat1622float2(r2[e]);
              a = bf(a + rf.x);
              b = bf(b + rf.y);
            }
            stream[c + 2 * e] = a;
            stream[c + 2 * e + 1] = b;
            xs[c + 2 * e] = a * gf.x;
            xs[c + 2 * e + 1] = b * gf.y;
            sq += a * a + b * b;
            kept[e] = __floats2bfloat162_rn(a, b);
          }
          if (blockIdx.x == 0 && l == P.num_layers - 1)
            *reinterpret_cast<uint4*>((p == 0 ? P.s1 : P.s2) + c) = *reinterpret_cast<const uint4*>(kept);
        }
        if (norm) {
          sq = warp_sum(sq);
          if (lane == 0) sumsq[warp] = sq;
        }
      }
      consumer_sync();
      if (tid == 0) stamp(P, epoch, 2);

      // The stages: a tile of r output rows (gate/up: r gate rows, then r up rows) of k columns.
      const int r = tile_rows(P, p);
      const int stage_rows = p == 2 ? 2 * r : r;
      const int wpr = CONSUMER_WARPS / stage_rows;          // warps per stage row, each a share of its columns
      const int row = warp / wpr, share = k / wpr;
      const int c0 = (warp % wpr) * share;
      int lo, hi;
      block_rows(n_out(P, p), lo, hi);
      // Each lane reads the same columns of every row it takes in this product: its share of x in registers.
      float xr[MAX_STEPS][8];
#pragma unroll
      for (int i = 0; i < MAX_STEPS; ++i) {
        const int c = c0 + i * 256 + lane * 8;
        if (i * 256 + lane * 8 < share) {
          const float4 xa = *reinterpret_cast<const float4*>(xs + c);
          const float4 xb = *reinterpret_cast<const float4*>(xs + c + 4);
          xr[i][0] = xa.x; xr[i][1] = xa.y; xr[i][2] = xa.z; xr[i][3] = xa.w;
          xr[i][4] = xb.x; xr[i][5] = xb.y; xr[i][6] = xb.z; xr[i][7] = xb.w;
        }
      }
      int t = 0;
      for (int r0 = lo; r0 < hi; r0 += r, ++it, ++t) {
        const int s = it % S;
        const bool stream_on = !(P.flags & SKIP_STREAM);
        if (stream_on) mbar_wait(&full[s], (it / S) & 1);
        if (tid == 0 && r0 == lo) stamp(P, epoch, 3);
        const int live = min(r, hi - r0);
        float acc = 0.f;                           // this lane's share of its row, in independent chains
        if ((p == 2 ? row % r : row) < live && !(P.flags & SKIP_DOTS)) {
          const __nv_bfloat16* wrow =
              reinterpret_cast<const __nv_bfloat16*>(ring + s * STAGE_BYTES) + row * k + c0 + lane * 8;
          uint4 w8[MAX_STEPS];
#pragma unroll
          for (int i = 0; i < MAX_STEPS; ++i)      // every load of the stage first, then the arithmetic
            if (i * 256 + lane * 8 < share) w8[i] = *reinterpret_cast<const uint4*>(wrow + i * 256);
          float chain[MAX_STEPS][2];
#pragma unroll
          for (int i = 0; i < MAX_STEPS; ++i) {
            chain[i][0] = chain[i][1] = 0.f;
            if (i * 256 + lane * 8 < share) {
              const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w8[i]);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float2 f = __bfloat1622float2(w2[e]);
                chain[i][0] = fmaf(f.x, xr[i][2 * e], chain[i][0]);
                chain[i][1] = fmaf(f.y, xr[i][2 * e + 1], chain[i][1]);
              }
            }
          }
#pragma unroll
          for (int i = 0; i < MAX_STEPS; ++i) acc += chain[i][0] + chain[i][1];
        }
        // The lane's sum goes to shared memory as is: the epilogue adds the lanes once per product, instead of a
        // warp reduction (five dependent shuffles) per stage.
        red[lane * MAX_TILES * CONSUMER_WARPS + t * CONSUMER_WARPS + warp] = acc;   // lane-major: see row_sum
        __syncwarp();                                // every lane's reads of the stage are done
        if (lane == 0 && stream_on) mbar_arrive(&empty[s]);
      }
      consumer_sync();
      if (tid == 0) stamp(P, epoch, 4);

      // Epilogue: one thread per output row of the block, its warps' lane sums in a fixed order.
      if (tid < hi - lo) {
        const int tt = tid / r, j = tid % r;
        const float* part = red + tt * CONSUMER_WARPS;
        const float y = row_sum(part + j * wpr, wpr);
        float rstd = 1.f;
        if (p == 0 || p == 2) {
          float total = 0.f;
          for (int q = 0; q < CONSUMER_WARPS; ++q) total += sumsq[q];
          rstd = rsqrtf(total / k + P.eps);
        }
        const int o_row = lo + tid;
        if (p == 0) {
          P.qkv[o_row] = __float2bfloat16(y * rstd);
        } else if (p == 1) {
          P.o[o_row] = __float2bfloat16(y);
        } else if (p == 2) {
          const float gate = bf(y * rstd);
          const float up = bf(row_sum(part + (r + j) * wpr, wpr) * rstd);
          P.act[o_row] = __float2bfloat16(gate / (1.f + expf(-gate)) * up);
        } else {
          P.out[o_row] = __float2bfloat16(y);
        }
      }
      if (tid == 0) stamp(P, epoch, 5);
      if (flags) publish(P.counter + FLAG_STRIDE * (blockIdx.x + 1), epoch + 1);
    }
  }
}

}  // namespace minirt_chain

// What the Python side (ctypes) calls. It checks shapes, dtypes and alignment; this only sizes and launches.
// Returns a cudaError_t (0: launched); minirt_gemv_chain_error names it.
extern "C" int minirt_gemv_chain_launch(const long long* layers, int num_layers, const void* x, const void* residual,
                                        void* qkv, void* o, void* act, void* out, void* s1, void* s2,
                                        unsigned* counter, int hidden, int n_qkv, int k_o, int inter,
                                        const int* rows, int num_stages, float eps, int grid, int flags,
                                        long long* timeline, void* stream) {
  using namespace minirt_chain;
  Params p{};
  p.layers = layers;
  p.num_layers = num_layers;
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.residual = static_cast<const __nv_bfloat16*>(residual);
  p.qkv = static_cast<__nv_bfloat16*>(qkv);
  p.o = static_cast<__nv_bfloat16*>(o);
  p.act = static_cast<__nv_bfloat16*>(act);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.s1 = static_cast<__nv_bfloat16*>(s1);
  p.s2 = static_cast<__nv_bfloat16*>(s2);
  p.counter = counter;
  p.hidden = hidden;
  p.n_qkv = n_qkv;
  p.k_o = k_o;
  p.inter = inter;
  for (int i = 0; i < 4; ++i) p.rows[i] = rows[i];
  p.num_stages = num_stages;
  p.eps = eps;
  p.flags = flags;
  p.timeline = timeline;
  const int max_k = max(inter, max(k_o, hidden));
  const size_t smem = static_cast<size_t>(num_stages) * (STAGE_BYTES + 16) +
                      sizeof(float) * (max_k + hidden + MAX_TILES * CONSUMER_WARPS * 32 + CONSUMER_WARPS);
  cudaError_t err = cudaFuncSetAttribute(gemv_chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  gemv_chain_kernel<<<grid, THREADS, smem, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

extern "C" const char* minirt_gemv_chain_error(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
