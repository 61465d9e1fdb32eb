// Split-KV paged decode attention in ONE launch: the splits of a (sequence, KV head) form a
// thread-block cluster (Hopper, sm_90+) and reduce their partial softmaxes through distributed
// shared memory, so no partial result goes through HBM and no second kernel runs.
//
// Status: an experiment, not used by the engine (bench/cluster_decode.py; numbers in
// cluster_decode.py's docstring). At 1 x 4k it is slower than the Triton pair it meant to beat.
//
// Why: at batch 1 x 4k context the Triton split kernel (paged_decode.py) reads KV close to the
// bare-read floor, but its combine is a second launch costing ~3.7 us in the chain
// (bench/results/attention-anatomy-h100.log); a last-arrival combine through global atomics
// was slower still. Triton exposes neither clusters nor DSMEM, hence CUDA C++.
//
// Grid (num_splits, num_kv_heads, num_seqs), cluster (num_splits, 1, 1), WARPS warps per CTA.
// Each CTA attends its G query heads over keys [lo, hi) of its sequence, as in paged_decode.py
// (splits are whole tiles of WARPS x 16 keys; a window W keeps keys [len - W, len)). Each warp
// takes 16 keys of a tile and runs tensor-core MMAs (m16n8k16, fp32 accumulate):
//   scores   S [16 heads (G used) x 8 keys]  = Q [16 x 128] . K^T, two per 16 keys
//   output   O^T [128 dims x 8 heads]       += V^T [128 x 16 keys] . P^T [16 keys x 8 heads]
// P's accumulator layout is exactly the B operand of the second product, so probabilities
// never leave registers. The dot products' k index is a permutation of head_dim chosen so each
// lane loads whole 16-byte vectors (kDims comment below); the output rows are permuted dims.
// Warps keep their own online softmax (log2 units), merge through shared memory, and CTA rank
// r of the cluster writes outputs [r * per, (r + 1) * per) of the G x 128 block from every
// CTA's state over DSMEM, per = G * 128 / num_splits.
// PDL: the first STAGES tiles are requested before griddepcontrol.wait except the newest key
// (invariant, as in paged_decode.py: a decode step's KV write touches only each sequence's
// newest row); q, the newest key and every store come after it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;

namespace {

constexpr int kHeadDim = 128;
constexpr int kChunk = 16;  // keys per warp per tile; a tile is WARPS * kChunk keys
constexpr float kLog2e = 1.4426950408889634f;
// Block ids staged in shared memory per CTA: 16k keys at block size 16. Staging them keeps the
// table's latency out of the loop (one tile ahead, the id load's own latency stalled every
// tile of the first version of this kernel).
constexpr int kIdCache = 1024;

struct Params {  // mirrored by cluster_decode.py's ctypes structure: keep the order
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* sinks;  // [num_heads] fp32 or null
  int64_t q_stride_tok, q_stride_head;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int64_t out_stride_tok, out_stride_head;
  int64_t table_stride;
  int32_t block_size;
  int32_t sliding_window;  // 0: none
  float scale;             // softmax scale (natural units)
};

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1, __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1, __half) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack(float lo, float hi, __half) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat16 from_float(float x, __nv_bfloat16) {
  return __float2bfloat16(x);
}
__device__ __forceinline__ __half from_float(float x, __half) { return __float2half(x); }

// Element t of x and element t of y (8 x 16-bit each) as one register: (x_t low, y_t high).
__device__ __forceinline__ uint32_t pair(const uint4& x, const uint4& y, int t) {
  const uint32_t xw = (&x.x)[t / 2], yw = (&y.x)[t / 2];
  return __byte_perm(xw, yw, t % 2 ? 0x7632 : 0x5410);
}

__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// A reference point for exp2 of running maxima: -inf (nothing seen) maps to 0 so that
// exp2(-inf - ref) = 0 and never NaN.
__device__ __forceinline__ float finite_or_zero(float m) { return m == -INFINITY ? 0.f : m; }

// One warp's registers for one 16-key chunk. Lane = 4 * g + c (g = lane / 4, c = lane % 4).
// kDims: k[u][s] = K[key 8u + g][32s + 8c, +8). In the score MMA over dims 32s..32s+31 the
// lane's A (q) and B (k) registers use words .x/.y of this vector for the first k16 step and
// .z/.w for the second, the same permutation on both sides, so the dot product is unchanged.
// v_lo[i] / v_hi[i] = V[key kv(i)][8g, +8) / [64 + 8g, +8), kv(i) = 2c, 2c+1, 2c+8, 2c+9: the
// A operand of V^T's m-tile t is element t of these, so O^T's row (g, t) is dim 8g + t and
// row (g + 8, t) is dim 64 + 8g + t.
struct Chunk {
  uint4 k[2][4];
  uint4 v_lo[4], v_hi[4];
};

template <typename T, int G, int WARPS>
struct DecodeCta {
  static constexpr int kTile = WARPS * kChunk;

  const Params& p;
  const int32_t* table;
  const int* ids;  // shared memory: block ids of this CTA's range, from first_block on
  int first_block;
  const T* k_head;  // this KV head's row in slot 0 of block 0
  const T* v_head;
  int lo, hi, seq_len, g, c;

  __device__ DecodeCta(const Params& params, const int* staged_ids, int seq, int kv_head,
                       int split, int num_splits, int lane)
      : p(params), ids(staged_ids), g(lane >> 2), c(lane & 3) {
    seq_len = p.seq_lens[seq];
    const int first = p.sliding_window > 0 ? max(seq_len - p.sliding_window, 0) : 0;
    const int n = max(seq_len - first, 0);
    const int per_split = ((n + num_splits - 1) / num_splits + kTile - 1) / kTile * kTile;
    lo = first + split * per_split;
    hi = min(lo + per_split, seq_len);
    table = p.block_tables + static_cast<int64_t>(seq) * p.table_stride;
    first_block = lo / p.block_size;
    k_head = static_cast<const T*>(p.k_cache) + kv_head * p.k_stride_head;
    v_head = static_cast<const T*>(p.v_cache) + kv_head * p.v_stride_head;
  }

  // The cache block holding key `pos`: from the ids staged in shared memory, or from the
  // table for the part of a very long range that does not fit.
  __device__ __forceinline__ int64_t block_of(int pos) const {
    const int b = pos / p.block_size - first_block;
    return b < kIdCache ? ids[b] : __ldg(table + pos / p.block_size);
  }

  // Whether key `pos` is loaded now: inside the range, and not the newest key while the
  // previous kernel may still be writing it (`before_wait`); after the wait only the newest
  // key (`newest_only`, load_newest).
  __device__ __forceinline__ bool wanted(int pos, bool before_wait, bool newest_only) const {
    const bool newest = pos == seq_len - 1;
    return pos < hi && (newest_only ? newest : !(newest && before_wait));
  }

  __device__ __forceinline__ uint4 load(const T* row, int pos, int offset) const {
    const uint4* at = reinterpret_cast<const uint4*>(row + offset);
    return pos == seq_len - 1 ? __ldcg(at) : __ldg(at);  // the newest: never a stale L1 line
  }

  __device__ __forceinline__ const T* k_row(int pos) const {
    return k_head + block_of(pos) * p.k_stride_block + (pos % p.block_size) * p.k_stride_slot;
  }
  __device__ __forceinline__ const T* v_row(int pos) const {
    return v_head + block_of(pos) * p.v_stride_block + (pos % p.block_size) * p.v_stride_slot;
  }

  // The chunk of 16 keys at `start` into registers (zeros where not `wanted`, unless
  // newest_only, which overwrites only the newest key's registers).
  __device__ __forceinline__ void load_chunk(int start, Chunk& ch, bool before_wait,
                                             bool newest_only = false) const {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pos = start + 8 * u + g;
      if (wanted(pos, before_wait, newest_only)) {
        const T* row = k_row(pos);
#pragma unroll
        for (int s = 0; s < 4; ++s) ch.k[u][s] = load(row, pos, 32 * s + 8 * c);
      } else if (!newest_only) {
#pragma unroll
        for (int s = 0; s < 4; ++s) ch.k[u][s] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int pos = start + 2 * c + (i & 1) + 8 * (i >> 1);
      if (wanted(pos, before_wait, newest_only)) {
        const T* row = v_row(pos);
        ch.v_lo[i] = load(row, pos, 8 * g);
        ch.v_hi[i] = load(row, pos, 64 + 8 * g);
      } else if (!newest_only) {
        ch.v_lo[i] = make_uint4(0, 0, 0, 0);
        ch.v_hi[i] = make_uint4(0, 0, 0, 0);
      }
    }
  }

  // One online-softmax step over the chunk at `start`. m: running max of head g (log2 units,
  // the same in the 4 lanes of g); l: this lane's share of head g's running sum; acc[t]:
  // O^T rows (g, t) and (g + 8, t) for heads 2c and 2c + 1 (MMA accumulator layout).
  __device__ __forceinline__ void attend(int start, const Chunk& ch, const uint4 (&q)[4],
                                         float q_scale, float& m, float& l,
                                         float (&acc)[8][4]) const {
    float s[2][4];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      s[u][0] = s[u][1] = s[u][2] = s[u][3] = 0.f;
#pragma unroll
      for (int d = 0; d < 4; ++d) {
        mma(s[u], q[d].x, 0u, q[d].y, 0u, ch.k[u][d].x, ch.k[u][d].y, T());
        mma(s[u], q[d].z, 0u, q[d].w, 0u, ch.k[u][d].z, ch.k[u][d].w, T());
      }
    }
    // s[u][0..1]: head g, keys start + 8u + 2c + {0, 1} (s[u][2..3]: padding heads).
    float chunk_max = -INFINITY;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool visible = start + 8 * u + 2 * c + e < hi;
        s[u][e] = visible ? s[u][e] * q_scale : -INFINITY;
        chunk_max = fmaxf(chunk_max, s[u][e]);
      }
    }
    chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, 1));
    chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, 2));
    const float m_new = fmaxf(m, chunk_max);
    const float ref = finite_or_zero(m_new);
    const float alpha = exp2f(m - ref);
    m = m_new;
    float p[2][2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      p[u][0] = exp2f(s[u][0] - ref);
      p[u][1] = exp2f(s[u][1] - ref);
    }
    l = l * alpha + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
    // Rescale O^T's columns: heads 2c and 2c + 1, whose alpha the lanes of g = 2c, 2c + 1 hold.
    const float alpha0 = __shfl_sync(0xffffffffu, alpha, 8 * c);
    const float alpha1 = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);
    const uint32_t b0 = pack(p[0][0], p[0][1], T()), b1 = pack(p[1][0], p[1][1], T());
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      acc[t][0] *= alpha0;
      acc[t][1] *= alpha1;
      acc[t][2] *= alpha0;
      acc[t][3] *= alpha1;
      mma(acc[t], pair(ch.v_lo[0], ch.v_lo[1], t), pair(ch.v_hi[0], ch.v_hi[1], t),
          pair(ch.v_lo[2], ch.v_lo[3], t), pair(ch.v_hi[2], ch.v_hi[3], t), b0, b1, T());
    }
  }
};

template <typename T, int G, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, 1) decode_cluster_kernel(const Params p) {
  using Cta = DecodeCta<T, G, WARPS>;
  constexpr int kThreads = WARPS * 32, kTile = Cta::kTile;
  __shared__ float warp_m[WARPS][G], warp_l[WARPS][G];
  __shared__ float warp_acc[WARPS][G][kHeadDim];
  __shared__ float cta_m[G], cta_l[G];  // read by the whole cluster
  __shared__ float cta_o[G][kHeadDim];
  __shared__ int staged_ids[kIdCache];

  cg::cluster_group cluster = cg::this_cluster();
  const int num_splits = gridDim.x;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Cta cta(p, staged_ids, seq, kv_head, blockIdx.x, num_splits, lane);
  const int mine = warp * kChunk;  // this warp's chunk within each tile

  // Tables are filled at least two kernels earlier (attention_gpu.py): safe before the wait.
  const int num_blocks = cta.hi > cta.lo ? (cta.hi - 1) / p.block_size - cta.first_block + 1 : 0;
  for (int b = threadIdx.x; b < min(num_blocks, kIdCache); b += kThreads)
    staged_ids[b] = __ldg(cta.table + cta.first_block + b);
  __syncthreads();

  Chunk chunks[STAGES];
#pragma unroll
  for (int s = 0; s < STAGES; ++s) cta.load_chunk(cta.lo + s * kTile + mine, chunks[s], true);

  wait_for_previous_kernel();  // q and this step's newest key come from earlier kernels

#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    cta.load_chunk(cta.lo + s * kTile + mine, chunks[s], false, /*newest_only=*/true);
  // q row g (zeros for padding rows g >= G), dims 32d + 8c .. +8: the A operand (kDims).
  uint4 q[4];
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    q[d] = make_uint4(0, 0, 0, 0);
    if (cta.g < G)
      q[d] = __ldcg(reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.q) + seq * p.q_stride_tok +
          (kv_head * G + cta.g) * p.q_stride_head + 32 * d + 8 * cta.c));
  }
  const float q_scale = p.scale * kLog2e;

  float m = -INFINITY, l = 0.f, acc[8][4];
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  for (int base = cta.lo; base < cta.hi; base += STAGES * kTile) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int start = base + s * kTile;
      if (start >= cta.hi) break;
      cta.attend(start + mine, chunks[s], q, q_scale, m, l, acc);
      cta.load_chunk(start + STAGES * kTile + mine, chunks[s], false);  // STAGES tiles ahead
    }
  }

  // The warp's state into shared memory: m and the full l of head g, O^T columns by head.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (cta.c == 0 && cta.g < G) {
    warp_m[warp][cta.g] = m;
    warp_l[warp][cta.g] = l;
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int head = 2 * cta.c + e;
    if (head < G) {
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        warp_acc[warp][head][8 * cta.g + t] = acc[t][e];
        warp_acc[warp][head][64 + 8 * cta.g + t] = acc[t][2 + e];
      }
    }
  }
  __syncthreads();

  // The CTA's state: max, sum and unnormalized output relative to that max.
  for (int o = threadIdx.x; o < G * kHeadDim; o += kThreads) {
    const int head = o / kHeadDim, d = o % kHeadDim;
    float m_cta = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_cta = fmaxf(m_cta, warp_m[w][head]);
    const float ref = finite_or_zero(m_cta);
    float l_cta = 0.f, o_cta = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float weight = exp2f(warp_m[w][head] - ref);
      l_cta += warp_l[w][head] * weight;
      o_cta += warp_acc[w][head][d] * weight;
    }
    cta_o[head][d] = o_cta;
    if (d == 0) {
      cta_m[head] = m_cta;
      cta_l[head] = l_cta;
    }
  }
  cluster.sync();  // every CTA's state is written and visible cluster-wide

  const int rank = static_cast<int>(cluster.block_rank());
  const int per = G * kHeadDim / num_splits;
  for (int t = threadIdx.x; t < per; t += kThreads) {
    const int o = rank * per + t;
    const int g = o / kHeadDim, d = o % kHeadDim;
    const int head = kv_head * G + g;
    const float sink = p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
    float m_all = sink;
    for (int r = 0; r < num_splits; ++r)
      m_all = fmaxf(m_all, cluster.map_shared_rank(cta_m, r)[g]);
    const float ref = finite_or_zero(m_all);
    float denom = exp2f(sink - ref), num = 0.f;  // exp2(-inf) = 0 without sinks
    for (int r = 0; r < num_splits; ++r) {
      const float weight = exp2f(cluster.map_shared_rank(cta_m, r)[g] - ref);
      denom += cluster.map_shared_rank(cta_l, r)[g] * weight;
      num += cluster.map_shared_rank(&cta_o[0][0], r)[o] * weight;
    }
    T* out = static_cast<T*>(p.out) + seq * p.out_stride_tok + head * p.out_stride_head + d;
    *out = from_float(denom > 0.f ? num / denom : 0.f, T());
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

using KernelFn = void (*)(const Params);

template <typename T, int G>
KernelFn pick_shape(int warps, int stages) {
  if (warps == 4 && stages == 2) return decode_cluster_kernel<T, G, 4, 2>;
  if (warps == 8 && stages == 2) return decode_cluster_kernel<T, G, 8, 2>;
  if (warps == 4 && stages == 1) return decode_cluster_kernel<T, G, 4, 1>;
  return nullptr;
}

template <typename T>
KernelFn pick_group(int group, int warps, int stages) {
  switch (group) {
    case 1: return pick_shape<T, 1>(warps, stages);
    case 2: return pick_shape<T, 2>(warps, stages);
    case 4: return pick_shape<T, 4>(warps, stages);
    case 8: return pick_shape<T, 8>(warps, stages);
    default: return nullptr;
  }
}

KernelFn pick_kernel(int dtype, int group, int warps, int stages) {
  if (dtype == 0) return pick_group<__nv_bfloat16>(group, warps, stages);
  if (dtype == 1) return pick_group<__half>(group, warps, stages);
  return nullptr;
}

cudaLaunchConfig_t cluster_config(int warps, int num_splits, int num_kv_heads, int num_seqs,
                                  cudaLaunchAttribute* attrs) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_splits, num_kv_heads, num_seqs);
  config.blockDim = dim3(warps * 32, 1, 1);
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = num_splits;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  config.attrs = attrs;
  config.numAttrs = 1;
  return config;
}

cudaError_t prepare(KernelFn kernel, int num_splits, int device) {
  // This library links its own CUDA runtime: make the caller's device current for it.
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess && num_splits > 8)  // 16-CTA clusters are Hopper's non-portable max
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return err;
}

}  // namespace

// `params` points at a Params (a void pointer keeps this symbol's linkage external).
// Returns 0 or a cudaError_t; -1 for a (dtype, group, stages) that is not built.
extern "C" int tandem_decode_cluster_launch(const void* params, int dtype, int group,
                                            int warps, int stages, int num_seqs,
                                            int num_kv_heads, int num_splits, int device,
                                            void* stream, int pdl) {
  const KernelFn kernel = pick_kernel(dtype, group, warps, stages);
  if (kernel == nullptr) return -1;
  const cudaError_t err = prepare(kernel, num_splits, device);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t config = cluster_config(warps, num_splits, num_kv_heads, num_seqs, attrs);
  config.stream = static_cast<cudaStream_t>(stream);
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = pdl;
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, kernel, *static_cast<const Params*>(params));
}

// How many clusters of `num_splits` CTAs can be resident at once (<0 on error).
extern "C" int tandem_decode_cluster_max_active(int dtype, int group, int warps, int stages,
                                                int num_splits, int device) {
  const KernelFn kernel = pick_kernel(dtype, group, warps, stages);
  if (kernel == nullptr) return -1;
  if (prepare(kernel, num_splits, device) != cudaSuccess) return -2;
  cudaLaunchAttribute attrs[1];
  const cudaLaunchConfig_t config = cluster_config(warps, num_splits, 1, 1, attrs);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) return -3;
  return clusters;
}
