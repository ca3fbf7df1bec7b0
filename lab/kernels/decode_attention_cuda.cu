// A decode step's attention side in one CUDA kernel: the q/k RMSNorm and rotation, the K/V cache write, split-KV
// attention over the paged cache and the splits' combine (decode_attention_cuda.py has the contract).
//
// One cluster of NUM_SPLITS blocks per (sequence, KV head); block `split` of it takes one contiguous share of the
// sequence's keys, as the Triton split-KV kernel does. Before its programmatic-dependent-launch wait a block loads
// what the kernel before it does not write: the metadata, cos/sin, the norm weights and its first tile of earlier
// steps' keys and values (the caller guarantees that they were written before the current run of PDL launches
// began, as `paged_attention_triton`'s prefetch_kv says: the forward starts with a kernel launched without PDL,
// which starts only once everything before it has finished). After it: the raw q (every block of the cluster
// normalizes and rotates its KV head's query group itself), and in the block whose share holds the new position
// the raw k and v, which it rotates, writes to their cache slot and uses from shared memory. Each block keeps a
// running softmax over its share, then the cluster's blocks exchange (max, sum, weighted values) through
// distributed shared memory: block r combines its slice of the output from every block's partials (the combine of
// flash-decoding, Dao et al. 2023, without the second kernel or a trip through global memory; Hopper thread block
// clusters).
//
// Built per (element type, head dim, query group) by nvcc with -DMINIRT_T_F32 (else bf16) -DMINIRT_D=16|32|64|128
// -DMINIRT_G=1|2|4|8; needs compute capability 9.0 (clusters, griddepcontrol).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace cg = cooperative_groups;

#ifndef MINIRT_D
#define MINIRT_D 128
#endif
#ifndef MINIRT_G
#define MINIRT_G 2
#endif
#ifndef MINIRT_SKIP
#define MINIRT_SKIP 0           // benchmarks only: 1 leaves out the cluster's combine, 2 the q/k norm and rotation,
                                // 4 (with 1) launches without clusters
#endif

namespace minirt_decode_attention {

#if defined(MINIRT_T_F32)
using T = float;
#else
using T = __nv_bfloat16;
#endif

constexpr int D = MINIRT_D;             // head dim
constexpr int G = MINIRT_G;             // query heads per KV head
constexpr int THREADS = 256;
constexpr int TILE = 64;                // keys per tile: 4 threads a key for q.k
constexpr int DPT = D / 4;              // a q.k thread's dims of its key
constexpr int PAIRS = D / 2;            // p.v: a thread's two dims of the output ...
constexpr int KG = THREADS / PAIRS;     // ... for one of KG groups of keys
constexpr int KPG = TILE / KG;          // keys per group
constexpr int MAX_SPLITS = 16;
static_assert(D >= 16 && (D & (D - 1)) == 0 && D <= 128, "head dim: a power of two from 16 to 128");
static_assert(KG >= 1 && TILE % KG == 0, "p.v mapping");

__device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }
__device__ __forceinline__ T from_f(float x) { return static_cast<T>(x); }   // round to nearest even
// x rounded to T and back, as eager torch stores each op's result (float32: the identity)
__device__ __forceinline__ float rnd(float x) { return to_f(from_f(x)); }

struct Params {
  const T* q;  const T* k;  const T* v;      // raw projections: token t's head h at q + t * stride_q + h * D
  long long stride_q, stride_k, stride_v;
  const T* cos;  const T* sin;               // [tokens, D] rows (a token's at cos + t * stride_cs)
  long long stride_cs;
  const T* q_weight;  const T* k_weight;     // [D] each, or null: no q/k norm
  float eps, scale;
  T* k_cache;  T* v_cache;                   // [blocks, block_size, Hkv, D]; slot s at s * stride_slot
  long long stride_slot;
  const long long* slot_mapping;             // [tokens]
  const long long* block_tables;             // [seqs, stride_bt]
  long long stride_bt;
  const long long* context_lens;             // [seqs]; a decode's new position is context_len - 1
  int block_size;
  T* out;                                    // [tokens, H * D]
  long long stride_out;
  int pdl;
};

// n elements of T from src into dst, in 16-, 8- or 4-byte loads (src aligned to them)
template <int N>
__device__ __forceinline__ void load_n(const T* src, T* dst) {
  constexpr int BYTES = N * sizeof(T);
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if constexpr (BYTES % 8 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 8; ++i)
      reinterpret_cast<uint2*>(dst)[i] = reinterpret_cast<const uint2*>(src)[i];
  } else {
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
  }
}

__device__ __forceinline__ void pdl_wait(int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

struct Shared {
  float q[G][D];              // the rotated query group, dim d of head g at [g][(d % DPT) * 4 + d / DPT]
  float k_new[D], v_new[D];   // the new position's rotated key and its value (the owner block only)
  float p[G][TILE];           // a tile's weights, rounded to T as the p.v operand
  float warp_maxes[G][THREADS / 32], warp_sums[G][THREADS / 32];
  float red[KG][G][D];        // the key groups' p.v sums
  float part_m[G], part_l[G]; // this block's partial results, read by the cluster
  float part_acc[G][D];
};

__global__ void __launch_bounds__(THREADS) decode_attention_kernel(const Params p) {
  __shared__ Shared sh;
  const int split = blockIdx.x, num_splits = gridDim.x;
  const int kv_head = blockIdx.y, seq = blockIdx.z;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  if (p.pdl) asm volatile("griddepcontrol.launch_dependents;");

  // Before the wait: what the kernel before does not write (see the top of the file).
  const int ctx = static_cast<int>(p.context_lens[seq]);
  const int pos = ctx - 1;                                     // the new token's position
  const int per = (ctx + num_splits - 1) / num_splits;
  const int share = (per + TILE - 1) / TILE * TILE;
  const int lo = split * share;
  const int hi = min(ctx, lo + share);
  const bool owner = lo <= pos && pos < hi;
  const long long* table = p.block_tables + seq * p.stride_bt;
  const long long kv_off = static_cast<long long>(kv_head) * D;

  // q.k mapping: key kk = t / 4 of the tile, dims seg * DPT ... of it; p.v mapping: dims 2 * dp, 2 * dp + 1 of the
  // keys kg * KPG ... of the tile
  const int kk = t >> 2, seg = t & 3;
  const int dp = t % PAIRS, kg = t / PAIRS;
  T kreg[DPT];
  T vreg[KPG][2];
  auto load_tile = [&](int start) {        // the new position's key and value come from shared memory
    const int n = start + kk;
    if (n < hi && n != pos) {
      const long long block = table[n / p.block_size];
      const long long row = block * p.block_size + n % p.block_size;
      load_n<DPT>(p.k_cache + row * p.stride_slot + kv_off + seg * DPT, kreg);
    }
#pragma unroll
    for (int j = 0; j < KPG; ++j) {
      const int m = start + kg * KPG + j;
      if (m < hi && m != pos) {
        const long long block = table[m / p.block_size];
        const long long row = block * p.block_size + m % p.block_size;
        load_n<2>(p.v_cache + row * p.stride_slot + kv_off + 2 * dp, vreg[j]);
      } else {                               // weight 0 for keys past the share: no stale NaN bits
        vreg[j][0] = vreg[j][1] = from_f(0.f);
      }
    }
  };
  if (lo < hi) load_tile(lo);          // earlier steps' keys and values of the first tile

  // cos/sin of the new position and the norms' weights: each lane's pairs (d, d + D/2), d = lane + 32 i
  constexpr int LANE_PAIRS = (PAIRS + 31) / 32;
  float c1[LANE_PAIRS], c2[LANE_PAIRS], s1[LANE_PAIRS], s2[LANE_PAIRS], qw1[LANE_PAIRS], qw2[LANE_PAIRS],
      kw1[LANE_PAIRS], kw2[LANE_PAIRS];
  const bool norm = p.q_weight != nullptr;
#pragma unroll
  for (int i = 0; i < LANE_PAIRS; ++i) {
    const int d = lane + 32 * i;
    if (d < PAIRS) {
      const T* cs = p.cos + seq * p.stride_cs;
      const T* sn = p.sin + seq * p.stride_cs;
      c1[i] = to_f(cs[d]); c2[i] = to_f(cs[d + PAIRS]);
      s1[i] = to_f(sn[d]); s2[i] = to_f(sn[d + PAIRS]);
      if (norm) {
        qw1[i] = to_f(p.q_weight[d]); qw2[i] = to_f(p.q_weight[d + PAIRS]);
        kw1[i] = to_f(p.k_weight[d]); kw2[i] = to_f(p.k_weight[d + PAIRS]);
      }
    }
  }
  const long long slot = owner ? p.slot_mapping[seq] : 0;

  pdl_wait(p.pdl);                           // q, k and v are the kernel before's output

  // The query group (every block), and in the owner block the new key (rotated, written to its slot) and value.
  const int items = G + (owner ? 2 : 0);
  for (int item = warp; item < items; item += THREADS / 32) {
    if (item == G + 1) {                     // v: copied to its slot and kept for the tile
      const T* src = p.v + seq * p.stride_v + kv_off;
      for (int d = lane; d < D; d += 32) {
        const T x = src[d];
        p.v_cache[slot * p.stride_slot + kv_off + d] = x;
        sh.v_new[d] = to_f(x);
      }
      continue;
    }
    const bool is_q = item < G;
    const T* src = is_q ? p.q + seq * p.stride_q + static_cast<long long>(kv_head * G + item) * D
                        : p.k + seq * p.stride_k + kv_off;
    float x1[LANE_PAIRS], x2[LANE_PAIRS];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < LANE_PAIRS; ++i) {
      const int d = lane + 32 * i;
      x1[i] = d < PAIRS ? to_f(src[d]) : 0.f;
      x2[i] = d < PAIRS ? to_f(src[d + PAIRS]) : 0.f;
      ss += x1[i] * x1[i] + x2[i] * x2[i];
    }
    if (norm && !(MINIRT_SKIP & 2)) {
      const float rstd = rsqrtf(warp_sum(ss) / D + p.eps);
#pragma unroll
      for (int i = 0; i < LANE_PAIRS; ++i) {
        x1[i] = rnd((is_q ? qw1[i] : kw1[i]) * rnd(x1[i] * rstd));
        x2[i] = rnd((is_q ? qw2[i] : kw2[i]) * rnd(x2[i] * rstd));
      }
    }
#pragma unroll
    for (int i = 0; i < LANE_PAIRS; ++i) {
      const int d = lane + 32 * i;
      if (d >= PAIRS) continue;
      const float o1 = (MINIRT_SKIP & 2) ? x1[i] : rnd(rnd(x1[i] * c1[i]) + rnd(-x2[i] * s1[i]));
      const float o2 = (MINIRT_SKIP & 2) ? x2[i] : rnd(rnd(x2[i] * c2[i]) + rnd(x1[i] * s2[i]));
      if (is_q) {
        const int e = d + PAIRS;
        sh.q[item][(d % DPT) * 4 + d / DPT] = o1;
        sh.q[item][(e % DPT) * 4 + e / DPT] = o2;
      } else {
        p.k_cache[slot * p.stride_slot + kv_off + d] = from_f(o1);
        p.k_cache[slot * p.stride_slot + kv_off + d + PAIRS] = from_f(o2);
        sh.k_new[d] = o1;
        sh.k_new[d + PAIRS] = o2;
      }
    }
  }
  __syncthreads();

  // Running softmax over the share, a tile of TILE keys at a time (the first one loaded before the wait).
  float m_i[G], l_i[G], acc[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m_i[g] = -INFINITY; l_i[g] = 0.f; acc[g][0] = acc[g][1] = 0.f;
  }
  for (int start = lo; start < hi; start += TILE) {
    if (start != lo) {
      __syncthreads();                       // the last tile's weights are read
      load_tile(start);
    }
    const int n = start + kk;
    if (n == pos) {
#pragma unroll
      for (int i = 0; i < DPT; ++i) kreg[i] = from_f(sh.k_new[seg * DPT + i]);
    }
#pragma unroll
    for (int j = 0; j < KPG; ++j) {
      if (start + kg * KPG + j == pos) {
        vreg[j][0] = from_f(sh.v_new[2 * dp]);
        vreg[j][1] = from_f(sh.v_new[2 * dp + 1]);
      }
    }
    // q.k: four threads a key, each DPT dims, then summed across them
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < DPT; ++i) sum += sh.q[g][i * 4 + seg] * to_f(kreg[i]);
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      s[g] = n < hi ? sum * p.scale : -INFINITY;
    }
    // the tile's maximum per head: within the warp's 8 keys, then across warps
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = s[g];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if (lane == 0) sh.warp_maxes[g][warp] = mx;
    }
    __syncthreads();
    float alpha[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = m_i[g];
#pragma unroll
      for (int w = 0; w < THREADS / 32; ++w) mx = fmaxf(mx, sh.warp_maxes[g][w]);
      const float m_use = mx == -INFINITY ? 0.f : mx;      // no visible key yet: no NaN
      const float pk = __expf(s[g] - m_use);
      alpha[g] = __expf(m_i[g] - m_use);
      m_i[g] = mx;
      float sum = pk;
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) sh.warp_sums[g][warp] = sum;
      if (seg == 0) sh.p[g][kk] = rnd(pk);
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < THREADS / 32; ++w) sum += sh.warp_sums[g][w];
      l_i[g] = l_i[g] * alpha[g] + sum;
      float a0 = 0.f, a1 = 0.f;
#pragma unroll
      for (int j = 0; j < KPG; ++j) {
        const float pj = sh.p[g][kg * KPG + j];
        a0 += pj * to_f(vreg[j][0]);
        a1 += pj * to_f(vreg[j][1]);
      }
      acc[g][0] = acc[g][0] * alpha[g] + a0;
      acc[g][1] = acc[g][1] * alpha[g] + a1;
    }
  }
  // This block's partials: the key groups' sums added, then (max, sum, weighted values) for the cluster.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    sh.red[kg][g][2 * dp] = acc[g][0];
    sh.red[kg][g][2 * dp + 1] = acc[g][1];
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (t == g) {
      sh.part_m[g] = m_i[g];
      sh.part_l[g] = l_i[g];
    }
  }
  __syncthreads();
  for (int i = t; i < G * D; i += THREADS) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < KG; ++j) sum += sh.red[j][i / D][i % D];
    sh.part_acc[i / D][i % D] = sum;
  }

  // The combine: block r of the cluster writes outputs r * per_block ... of the query group, from every block's
  // partials. out = sum_j exp(m_j - M) acc_j / sum_j exp(m_j - M) l_j, M = max_j m_j (an empty share: m = -inf).
  if (MINIRT_SKIP & 1) {                     // each block writes its own partial output, uncombined
    for (int i = t; i < G * D; i += THREADS)
      p.out[seq * p.stride_out + static_cast<long long>(kv_head * G + i / D) * D + i % D] =
          from_f(sh.part_acc[i / D][i % D] / sh.part_l[i / D]);
    return;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();                            // every block's partials written (release / acquire)
  const int rank = static_cast<int>(cluster.block_rank());
  const int per_block = (G * D + num_splits - 1) / num_splits;   // at most THREADS (the caller's num_splits)
  const int i = rank * per_block + t;
  if (t < per_block && i < G * D) {
    const int g = i / D, d = i % D;
    float mj[MAX_SPLITS], lj[MAX_SPLITS], aj[MAX_SPLITS];
    float big_m = -INFINITY;
#pragma unroll
    for (int j = 0; j < MAX_SPLITS; ++j) {   // unrolled: every block's loads in flight at once
      if (j < num_splits) {
        mj[j] = cluster.map_shared_rank(&sh.part_m[0], j)[g];
        lj[j] = cluster.map_shared_rank(&sh.part_l[0], j)[g];
        aj[j] = cluster.map_shared_rank(&sh.part_acc[0][0], j)[g * D + d];
        big_m = fmaxf(big_m, mj[j]);
      }
    }
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_SPLITS; ++j) {
      if (j < num_splits) {
        const float w = __expf(mj[j] - big_m);
        num += w * aj[j];
        den += w * lj[j];
      }
    }
    p.out[seq * p.stride_out + static_cast<long long>(kv_head * G + g) * D + d] = from_f(num / den);
  }
  cluster.sync();                            // no block leaves while another reads its shared memory
}

}  // namespace minirt_decode_attention

// What the Python side (ctypes) calls; it checks shapes and dtypes. Grid (num_splits, num_kv_heads, num_seqs) in
// clusters of num_splits blocks. Returns a cudaError_t (0: launched).
extern "C" int minirt_decode_attention_launch(
    const void* q, const void* k, const void* v, long long stride_q, long long stride_k, long long stride_v,
    const void* cos, const void* sin, long long stride_cs, const void* q_weight, const void* k_weight, float eps,
    float scale, void* k_cache, void* v_cache, long long stride_slot, const long long* slot_mapping,
    const long long* block_tables, long long stride_bt, const long long* context_lens, int block_size, void* out,
    long long stride_out, int num_seqs, int num_kv_heads, int num_splits, int pdl, void* stream) {
  using namespace minirt_decode_attention;
  static bool configured[64] = {};           // the attribute is set per device, once
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (device >= 64 || !configured[device]) {
    err = cudaFuncSetAttribute(decode_attention_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (device < 64) configured[device] = true;
  }
  Params p{};
  p.q = static_cast<const T*>(q); p.k = static_cast<const T*>(k); p.v = static_cast<const T*>(v);
  p.stride_q = stride_q; p.stride_k = stride_k; p.stride_v = stride_v;
  p.cos = static_cast<const T*>(cos); p.sin = static_cast<const T*>(sin); p.stride_cs = stride_cs;
  p.q_weight = static_cast<const T*>(q_weight); p.k_weight = static_cast<const T*>(k_weight);
  p.eps = eps; p.scale = scale;
  p.k_cache = static_cast<T*>(k_cache); p.v_cache = static_cast<T*>(v_cache); p.stride_slot = stride_slot;
  p.slot_mapping = slot_mapping; p.block_tables = block_tables; p.stride_bt = stride_bt;
  p.context_lens = context_lens; p.block_size = block_size;
  p.out = static_cast<T*>(out); p.stride_out = stride_out; p.pdl = pdl;

  cudaLaunchConfig_t config{};
  config.gridDim = dim3(num_splits, num_kv_heads, num_seqs);
  config.blockDim = dim3(THREADS);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = (MINIRT_SKIP & 4) ? 1 : num_splits;   // 4 (with 1): no clusters
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = pdl;
  config.attrs = attrs;
  config.numAttrs = 2;
  err = cudaLaunchKernelEx(&config, decode_attention_kernel, p);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(cudaGetLastError());
}

// How many clusters of cluster_size blocks fit on the GPU at once (cudaOccupancyMaxActiveClusters), or -1 on error.
extern "C" int minirt_decode_attention_max_clusters(int cluster_size) {
  using namespace minirt_decode_attention;
  if (cudaFuncSetAttribute(decode_attention_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
    return -1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster_size, 8, 1);
  config.blockDim = dim3(THREADS);
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster_size;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, decode_attention_kernel, &config) != cudaSuccess) return -1;
  return clusters;
}

extern "C" const char* minirt_decode_attention_error(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
