// The layers' GEMV chain at batch 1 in one persistent CUDA kernel with its weights streamed through shared memory
// (a batch-1 megakernel probe, lab/pages/gemv-chain.md; lab/kernels/gemv_chain_cuda.py plans the tiles, builds it
// with nvcc, checks the arguments and launches it through ctypes).
//
// One thread block per SM, for the whole launch (every layer). Each block owns a contiguous range of output rows
// in each of a layer's four products, so it knows from the start every weight byte it will read, in order:
//   - a producer warp streams them, tile after tile, layer after layer, into a ring of shared-memory stages with
//     the bulk-copy engine (`cp.async.bulk`, completing on an mbarrier per stage); it waits only for a free stage,
//     never for activations, so the memory keeps streaming while the other warps wait for the rest of the grid;
//   - eight consumer warps load the previous product's output as it arrives, each thread its columns, into shared
//     memory (with the norm's prologue; the residual stream stays in shared memory from layer to layer), then take
//     the stages as they fill: each warp an eighth of the columns of every row of a tile, on the tensor cores
//     (mma.sync with x split into three bf16 parts that add up to it: the products are exact, their float32 sums
//     the tensor cores' own); the epilogue adds a row's eight warp sums in a fixed order (the same bits on every
//     run) and writes the row.
// No grid barrier: each output row is also written as a 32-bit word with the product's number in its upper half
// and the bf16 in its lower (NCCL's "LL" protocol: one store carries the value and its flag, so a reader that sees
// the flag has the value, with no fence), and the next product's readers poll their own words. Even and odd layers
// write separate buffers: a block rewrites one two layers later only after it has read the whole of a later
// gate/up output, which every block writes (each owns rows of it) after its last read of that buffer, so no reader
// can miss a value. (That order rests on relaxed accesses, block barriers and the polls' control dependences, as
// NCCL's LL buffers do, not on a release/acquire pair at GPU scope, which the PTX memory model would need to
// guarantee it: a fence.acq_rel.gpu before the gate/up stores and after their polls would.)
// The scheme is Hazy Research's Llama-1B "megakernel" (2025: weights loaded ahead through a shared-memory pipeline
// while instructions wait on counters) and the warp-specialized producer/consumer pipelines of CUTLASS's Hopper
// kernels, cut down to this chain.
//
//   per layer l:  qkv, s1 = gemv(x, W_qkv, norm g1, residual s0)     s0: the previous layer's s2 (layer 0: given)
//                 o       = gemv(qkv[:K_o], W_o)
//                 act, s2 = gemv(o, W_gate_up, norm g2, residual s1, silu_and_mul)
//                 x       = gemv(act, W_down)
// with `linear_gemv`'s arithmetic: the stream rounded to bf16, the norm applied as rstd * dot(w, g * s), gate and
// up rounded to bf16 before silu(gate) * up, float32 accumulation; the sums differ in order and, inside each
// tensor-core product, in rounding (its float32 additions align the terms to the largest and truncate).

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
constexpr int MAX_CHUNKS = 12;                   // a warp's share of a row: at most 12 x 32 columns
constexpr int GROUP = 4;                         // chunks whose weights a lane loads before their products
constexpr int MAX_TILES = 16;                    // stage tiles per block per product (the warp sums' buffer)
constexpr int MAX_X_VECS = 3;                    // a product's input: at most 3 x 4 x CONSUMERS columns
static_assert(MAX_X_VECS * 4 * CONSUMERS >= CONSUMER_WARPS * MAX_CHUNKS * 32, "the widest row the tiles allow");
// Params::flags, for lab/probes/gemv.py's breakdown of the time (each leaves a part out; results are then wrong)
constexpr int SKIP_BARRIERS = 1, SKIP_PROLOGUE = 2, SKIP_DOTS = 4, SKIP_STREAM = 8;
// Params::timeline: per block and product, the SM's clock when thread 0 starts the product, has its own input
// words, the block has its input, thread 0 has its first stage, all warps are through their stages, through the
// epilogue; when the producer issues the product's first and last copy (unset where it streams no rows of the
// product; gemv_chain_cuda.py's TIMELINE_STAMPS names them).
constexpr int STAMPS = 8;

// One of a layer's four products as gemv_chain_cuda.py's chain_plan tiles it (powers of two as shifts: no
// division in the kernel's loops).
struct Product {
  int n, k;          // output rows, input columns
  int rows_log2;     // output rows per stage tile (gate/up: pairs, gate rows then up rows in the stage)
};

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
  uint32_t* ll[4];                // each product's output as flagged words (qkv, o, act, out), even layers; zero at
  int ll_odd;                     // launch; odd layers' are ll_odd words further
  Product prod[4];                // qkv, o, gate/up, down
  int max_k;                      // the widest product's input columns
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
#ifndef MINIRT_WEIGHTS_EVICT_FIRST
#define MINIRT_WEIGHTS_EVICT_FIRST 0   // 1: the weights' copies ask L2 to evict them first (a probe)
#endif
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if MINIRT_WEIGHTS_EVICT_FIRST
  uint64_t policy;   // each weight byte is read once: keep L2 for the activations' words
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
               "%4;" :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
#else
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void consumer_sync() {      // named barrier 1: the consumer warps only
  asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory");
}
__device__ __forceinline__ float warp_sum(float v) {   // the same tree on every lane: lane 0's sum is fixed
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Flagged words: a row's bf16 in the lower half, the number of its product in the launch (1, 2, ...) in the
// upper. Relaxed at GPU scope: read from L2, not from the SM's own cache; each 32-bit word is one indivisible
// access (the vector load reads four of them).
__device__ __forceinline__ void store_flagged(uint32_t* p, __nv_bfloat16 v, uint32_t flag) {
  const uint32_t word = (flag << 16) | __bfloat16_as_ushort(v);
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(word) : "memory");
}
__device__ __forceinline__ uint4 load_flagged(const uint32_t* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ bool flagged(const uint4& v, uint32_t flag) {
  return ((v.x >> 16) == flag) & ((v.y >> 16) == flag) & ((v.z >> 16) == flag) & ((v.w >> 16) == flag);
}

// Output rows [lo, hi) of an n-row product owned by this block: an even split over the grid.
// (32-bit: the Python side keeps n x grid below 2**32.)
__device__ __forceinline__ void block_rows(int n, int& lo, int& hi) {
  lo = static_cast<int>(static_cast<unsigned>(n) * blockIdx.x / gridDim.x);
  hi = static_cast<int>(static_cast<unsigned>(n) * (blockIdx.x + 1) / gridDim.x);
}

__device__ __forceinline__ void stamp(const Params& P, int product, int slot) {
  P.timeline[(static_cast<long long>(blockIdx.x) * P.num_layers * 4 + product) * STAMPS + slot] = clock64();
}

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

// d += A B, m16n8k16, bf16 in, float32 sums: A's rows 0-7 given per lane by (a0, a2) (its rows 8-15 zero), B by
// (b0, b1), in mma.sync's fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16").
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %5}, {%7, %8}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(b0), "r"(b1));
}

// A block's rows of each product and its ring position (each of its threads keeps its own copy).
struct Block {
  int lo[4], hi[4];            // output rows [lo, hi) of each product
  uint32_t stage, phase;       // the next ring stage to take, and its mbarrier parity
};
__device__ __forceinline__ void next_stage(Block& b, int num_stages) {
  if (++b.stage == static_cast<uint32_t>(num_stages)) {
    b.stage = 0;
    b.phase ^= 1;
  }
}

// The producer: every weight tile of the block's rows of product p of one layer, in the consumers' order.
template <int p>
__device__ __forceinline__ void produce(const Params& P, Block& b, const __nv_bfloat16* w, int l, unsigned char* ring,
                                        uint64_t* full, uint64_t* empty, bool stamps) {
  const Product& pr = P.prod[p];
  const int r = 1 << pr.rows_log2;
  for (int r0 = b.lo[p]; r0 < b.hi[p]; r0 += r) {
    mbar_wait(&empty[b.stage], b.phase ^ 1);            // a fresh barrier passes parity 1 at once
    if (stamps && r0 == b.lo[p]) stamp(P, l * 4 + p, 6);
    if (stamps && r0 + r >= b.hi[p]) stamp(P, l * 4 + p, 7);
    const uint32_t bytes = static_cast<uint32_t>(min(r, b.hi[p] - r0) * pr.k) * 2u;
    unsigned char* stage = ring + b.stage * STAGE_BYTES;
    mbar_arrive_expect_tx(&full[b.stage], p == 2 ? 2 * bytes : bytes);
    bulk_load(stage, w + static_cast<long long>(r0) * pr.k, bytes, &full[b.stage]);
    if (p == 2)   // the up rows of the same outputs, r rows further in the stage
      bulk_load(stage + r * pr.k * 2, w + static_cast<long long>(P.prod[2].n + r0) * pr.k, bytes, &full[b.stage]);
    next_stage(b, P.num_stages);
  }
}

// The block's shared memory beside the ring: the warp sums, this product's input (the norm's weight applied), the
// residual stream (exact bf16 values, as float) and each warp's sum of squares.
struct Scratch {
  float* red;      // [MAX_TILES][CONSUMER_WARPS][8]: each warp's sums of a tile's rows
  __nv_bfloat16* xs;   // [3][max k]: this product's input in three parts (hi, mid, lo)
  float* stream;   // [hidden]
  float* sumsq;    // [CONSUMER_WARPS]
};

// The consumers' part of product p of layer l: input, stages, epilogue.
template <int p>
__device__ __forceinline__ void consume(const Params& P, Block& b, const Scratch& m, int l, unsigned char* ring,
                                        uint64_t* full, uint64_t* empty, bool stamps) {
  constexpr bool norm = p == 0 || p == 2;
  const Product& pr = P.prod[p];
  const int k = pr.k;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int epoch = l * 4 + p;                         // products finished before this one
  const bool first = p == 0 && l == 0;                 // the caller's x and residual: not written in this launch
  const bool stream_on = !(P.flags & SKIP_STREAM), dots = !(P.flags & SKIP_DOTS);

  // The norm's weight does not depend on the previous product: loaded first.
  uint2 gv[MAX_X_VECS];
  if (norm) {
    const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(P.layers[l * 6 + (p == 0 ? 4 : 5)]);
#pragma unroll
    for (int i = 0; i < MAX_X_VECS; ++i) {
      const int c = (tid + i * CONSUMERS) * 4;
      if (c < k) gv[i] = *reinterpret_cast<const uint2*>(g + c);
    }
  }
  if (stamps && tid == 0) stamp(P, epoch, 0);

  // Input: each thread 4 columns at a time, every load issued before the first is polled again (one round trip to
  // L2 when the words are there).
  float sq = 0.f;
  if (!(P.flags & SKIP_PROLOGUE)) {
    uint4 xv[MAX_X_VECS];
    uint2 rv[MAX_X_VECS];
    const uint32_t* in = P.ll[p == 0 ? 3 : p - 1] + (((p == 0 ? l - 1 : l) & 1) ? P.ll_odd : 0);
    const bool poll = !first && !(P.flags & SKIP_BARRIERS);
#pragma unroll
    for (int i = 0; i < MAX_X_VECS; ++i) {
      const int c = (tid + i * CONSUMERS) * 4;
      if (c >= k) continue;
      if (first) {
        const uint2 x2 = *reinterpret_cast<const uint2*>(P.x + c);     // as flagged words, flag left out
        xv[i] = make_uint4(x2.x & 0xffffu, x2.x >> 16, x2.y & 0xffffu, x2.y >> 16);
        if (P.residual != nullptr) rv[i] = *reinterpret_cast<const uint2*>(P.residual + c);
      } else {
        xv[i] = load_flagged(in + c);
      }
    }
#pragma unroll
    for (int i = 0; i < MAX_X_VECS; ++i) {
      const int c = (tid + i * CONSUMERS) * 4;
      if (c < k && poll)
        while (!flagged(xv[i], epoch)) xv[i] = load_flagged(in + c);
    }
    if (stamps && tid == 0) stamp(P, epoch, 1);
#pragma unroll
    for (int i = 0; i < MAX_X_VECS; ++i) {
      const int c = (tid + i * CONSUMERS) * 4;
      if (c >= k) continue;
      float4 v = make_float4(__uint_as_float(xv[i].x << 16), __uint_as_float(xv[i].y << 16),
                             __uint_as_float(xv[i].z << 16), __uint_as_float(xv[i].w << 16));
      if (norm) {
        float4 add;
        if (!first) {
          add = *reinterpret_cast<const float4*>(m.stream + c);   // the layer before's s2 (p = 0) or this layer's s1
        } else if (P.residual != nullptr) {
          const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&rv[i].x));
          const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&rv[i].y));
          add = make_float4(lo.x, lo.y, hi.x, hi.y);
        }
        if (!first || P.residual != nullptr) v = make_float4(bf(v.x + add.x), bf(v.y + add.y), bf(v.z + add.z),
                                                             bf(v.w + add.w));
        *reinterpret_cast<float4*>(m.stream + c) = v;
        sq = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, sq))));
        if (l == P.num_layers - 1 && blockIdx.x == 0) {
          const __nv_bfloat162 kept[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
          *reinterpret_cast<uint2*>((p == 0 ? P.s1 : P.s2) + c) = *reinterpret_cast<const uint2*>(kept);
        }
        const float2 g01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv[i].x));
        const float2 g23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv[i].y));
        v = make_float4(v.x * g01.x, v.y * g01.y, v.z * g23.x, v.w * g23.y);
      }
      // x as three bf16 parts that add up to it exactly (8 + 8 + 8 of float32's 24 bits), for the tensor cores.
      const float in[4] = {v.x, v.y, v.z, v.w};
      __nv_bfloat16 hi[4], mid[4], lo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        hi[e] = __float2bfloat16(in[e]);
        const float rest = in[e] - __bfloat162float(hi[e]);           // exact
        mid[e] = __float2bfloat16(rest);
        lo[e] = __float2bfloat16(rest - __bfloat162float(mid[e]));   // exact
      }
      *reinterpret_cast<uint2*>(m.xs + c) = *reinterpret_cast<const uint2*>(hi);
      *reinterpret_cast<uint2*>(m.xs + P.max_k + c) = *reinterpret_cast<const uint2*>(mid);
      *reinterpret_cast<uint2*>(m.xs + 2 * P.max_k + c) = *reinterpret_cast<const uint2*>(lo);
    }
    if (norm) {
      sq = warp_sum(sq);
      if (lane == 0) m.sumsq[warp] = sq;
    }
  }
  consumer_sync();
  float rstd = 1.f;
  if (norm) {
    float total = 0.f;
#pragma unroll
    for (int q = 0; q < CONSUMER_WARPS; ++q) total += m.sumsq[q];
    rstd = rsqrtf(total / k + P.eps);
  }
  if (stamps && tid == 0) stamp(P, epoch, 2);

  // The stages on the tensor cores: each warp a share of k (k / 8 columns) of every row of a tile, in chunks of 32
  // columns, each chunk two m16n8k16 products D += A B with the tile's rows as B's 8 columns (a lane loads 8
  // weights of row lane / 4) and x, split into three bf16 parts that add up to it exactly (x = hi + mid + lo), as
  // A's first three rows (the other 13 zero). The products are exact in float32; D adds them as the tensor cores
  // do (the terms aligned to the largest and truncated), then the two chains and the three parts are added with
  // ordinary float32 additions.
  const int g = lane / 4, q = lane % 4;               // A's row and B's column (the split part, the tile row)
  const int share = k / CONSUMER_WARPS;
  const int c0 = warp * share + 8 * q;                // the lane's first column of each chunk: c0 + 32 j
  bool live_chunk[MAX_CHUNKS];
  uint4 xa[MAX_CHUNKS];                               // A for the chunk's two products: (x0 x1)(x2 x3), (x4 x5)(x6 x7)
#pragma unroll
  for (int j = 0; j < MAX_CHUNKS; ++j) {
    live_chunk[j] = 32 * j + 8 * q < share;
    xa[j] = make_uint4(0u, 0u, 0u, 0u);
    if (live_chunk[j] && g < 3) xa[j] = *reinterpret_cast<const uint4*>(m.xs + g * P.max_k + c0 + 32 * j);
  }

  // The stages: tiles of r output rows (gate/up: r gate rows, then r up rows) of k columns.
  const int r = 1 << pr.rows_log2;
  const int rows = b.hi[p] - b.lo[p];
  const int tile_row = p == 2 ? (g & (r - 1)) : g;   // the lane's output row in its tile (gate/up: in its half)
  const bool in_tile = g < (p == 2 ? 2 * r : r);
  const int offset = g * k + c0;                      // its first weight in a stage, in bf16 elements
  for (int t = 0, r0 = 0; r0 < rows; ++t, r0 += r) {
    if (stream_on) mbar_wait(&full[b.stage], b.phase);
    if (stamps && tid == 0 && t == 0) stamp(P, epoch, 3);
    const bool live = in_tile && tile_row < rows - r0 && dots;
    const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(ring + b.stage * STAGE_BYTES) + offset;
    float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};   // two chains of D
#pragma unroll
    for (int j0 = 0; j0 < MAX_CHUNKS; j0 += GROUP) {  // GROUP chunks' loads in flight, then their products
      if (32 * j0 >= share) break;                  // the warp's chunks (the same for all its lanes)
      uint4 w8[GROUP];
#pragma unroll
      for (int j = 0; j < GROUP; ++j) {
        w8[j] = make_uint4(0u, 0u, 0u, 0u);
        if (live && live_chunk[j0 + j]) w8[j] = *reinterpret_cast<const uint4*>(w + 32 * (j0 + j));
      }
#pragma unroll
      for (int j = 0; j < GROUP; ++j) {
        if (32 * (j0 + j) >= share) break;
        mma_bf16(d[0], xa[j0 + j].x, xa[j0 + j].y, w8[j].x, w8[j].y);
        mma_bf16(d[1], xa[j0 + j].z, xa[j0 + j].w, w8[j].z, w8[j].w);
      }
    }
    __syncwarp();                                 // every lane's reads of the stage are done
    if (lane == 0 && stream_on) mbar_arrive(&empty[b.stage]);
    next_stage(b, P.num_stages);
    // Tile rows 2q and 2q + 1 of A's row g: add the three parts (lanes q, q + 4, q + 8) in a fixed order.
    float y0 = d[0][0] + d[1][0], y1 = d[0][1] + d[1][1];
    y0 += __shfl_xor_sync(0xffffffffu, y0, 4);
    y1 += __shfl_xor_sync(0xffffffffu, y1, 4);
    y0 += __shfl_xor_sync(0xffffffffu, y0, 8);
    y1 += __shfl_xor_sync(0xffffffffu, y1, 8);
    if (g == 0) *reinterpret_cast<float2*>(m.red + (t * CONSUMER_WARPS + warp) * 8 + 2 * q) = make_float2(y0, y1);
  }
  consumer_sync();
  if (stamps && tid == 0) stamp(P, epoch, 4);

  // Epilogue: one thread per output row of the block, its warps' sums in a fixed order; the row goes out as is and
  // as a flagged word for the next product's readers.
  if (tid < rows) {
    const float* part = m.red + (tid >> pr.rows_log2) * CONSUMER_WARPS * 8;
    const int j = tid & (r - 1);
    float y = 0.f;
#pragma unroll
    for (int w = 0; w < CONSUMER_WARPS; ++w) y += part[w * 8 + j];
    __nv_bfloat16 v;
    if (norm) y *= rstd;
    if (p == 2) {
      float u = 0.f;
#pragma unroll
      for (int w = 0; w < CONSUMER_WARPS; ++w) u += part[w * 8 + r + j];
      const float gate = bf(y), up = bf(u * rstd);
      v = __float2bfloat16(gate / (1.f + expf(-gate)) * up);
    } else {
      v = __float2bfloat16(y);
    }
    const int o_row = b.lo[p] + tid;
    (p == 0 ? P.qkv : p == 1 ? P.o : p == 2 ? P.act : P.out)[o_row] = v;
    store_flagged(P.ll[p] + ((l & 1) ? P.ll_odd : 0) + o_row, v, epoch + 1);
  }
  if (stamps && tid == 0) stamp(P, epoch, 5);
}

__global__ void __launch_bounds__(THREADS, 1) gemv_chain_kernel(const Params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int S = P.num_stages;
  unsigned char* ring = smem;                                                   // S x STAGE_BYTES
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + S * STAGE_BYTES);         // S
  uint64_t* empty = full + S;                                                   // S
  Scratch m;
  m.red = reinterpret_cast<float*>(empty + S);
  m.sumsq = m.red + MAX_TILES * CONSUMER_WARPS * 8;
  m.stream = m.sumsq + CONSUMER_WARPS;
  m.xs = reinterpret_cast<__nv_bfloat16*>(m.stream + P.prod[1].n);
  const bool stamps = P.timeline != nullptr;

  Block b;
#pragma unroll
  for (int p = 0; p < 4; ++p) block_rows(P.prod[p].n, b.lo[p], b.hi[p]);
  b.stage = 0;
  b.phase = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (threadIdx.x / 32 == CONSUMER_WARPS) {          // the producer: every weight tile of the launch, in order
    if (threadIdx.x % 32 == 0 && !(P.flags & SKIP_STREAM)) {
      for (int l = 0; l < P.num_layers; ++l) {
        const long long* lw = P.layers + l * 6;
        produce<0>(P, b, reinterpret_cast<const __nv_bfloat16*>(lw[0]), l, ring, full, empty, stamps);
        produce<1>(P, b, reinterpret_cast<const __nv_bfloat16*>(lw[1]), l, ring, full, empty, stamps);
        produce<2>(P, b, reinterpret_cast<const __nv_bfloat16*>(lw[2]), l, ring, full, empty, stamps);
        produce<3>(P, b, reinterpret_cast<const __nv_bfloat16*>(lw[3]), l, ring, full, empty, stamps);
      }
    }
    return;
  }

  for (int l = 0; l < P.num_layers; ++l) {
    consume<0>(P, b, m, l, ring, full, empty, stamps);
    consume<1>(P, b, m, l, ring, full, empty, stamps);
    consume<2>(P, b, m, l, ring, full, empty, stamps);
    consume<3>(P, b, m, l, ring, full, empty, stamps);
  }
}

}  // namespace minirt_chain

// What the Python side (ctypes) calls. It checks shapes, dtypes and alignment and plans the tiles (`plan`: per
// product n, k, rows_log2); this only sizes and launches. `sync`: zeroed 32-bit words for each
// product's flagged output, one after the other, each rounded up to 4 words, then the same again for odd layers
// (gemv_chain_cuda.py's sync_buffer).
// Returns a cudaError_t (0: launched); minirt_gemv_chain_error names it.
extern "C" int minirt_gemv_chain_launch(const long long* layers, int num_layers, const void* x, const void* residual,
                                        void* qkv, void* o, void* act, void* out, void* s1, void* s2,
                                        uint32_t* sync, const int* plan, int num_stages, float eps, int grid,
                                        int flags, long long* timeline, void* stream) {
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
  p.max_k = 0;
  p.ll_odd = 0;
  for (int i = 0; i < 4; ++i) {
    p.prod[i] = Product{plan[3 * i], plan[3 * i + 1], plan[3 * i + 2]};
    p.ll[i] = sync + p.ll_odd;
    p.ll_odd += (p.prod[i].n + 3) / 4 * 4;
    p.max_k = max(p.max_k, p.prod[i].k);
  }
  p.num_stages = num_stages;
  p.eps = eps;
  p.flags = flags;
  p.timeline = timeline;
  const size_t smem = static_cast<size_t>(num_stages) * (STAGE_BYTES + 16) +
                      sizeof(float) * (MAX_TILES * CONSUMER_WARPS * 8 + CONSUMER_WARPS + p.prod[1].n) +
                      sizeof(__nv_bfloat16) * 3 * p.max_k;
  cudaError_t err = cudaFuncSetAttribute(gemv_chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  gemv_chain_kernel<<<grid, THREADS, smem, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

extern "C" const char* minirt_gemv_chain_error(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
