// Split-KV paged decode attention in ONE launch: the splits of a (sequence, KV head) form a
// thread-block cluster (Hopper, sm_90+) and reduce their partial softmaxes through distributed
// shared memory, so no partial result goes through HBM and no second kernel runs.
//
// Status: an experiment, not used by the engine (bench/cluster_decode.py; numbers in
// cluster_decode.py's docstring).
//
// Why: at batch 1 x 4k context the Triton split kernel (paged_decode.py) reads KV close to the
// bare-read floor, but its combine is a second launch costing ~3.7 us in the chain
// (bench/results/attention-anatomy-h100.log); a last-arrival combine through global atomics
// was slower still. Triton exposes neither clusters nor DSMEM, hence CUDA C++.
//
// Grid (num_splits, num_kv_heads, num_seqs), cluster (num_splits, 1, 1), WARPS warps per CTA.
// Each CTA attends its G query heads over keys [lo, hi) of its sequence, as in paged_decode.py
// (splits are whole tiles of WARPS x 16 keys; a window W keeps keys [len - W, len)).
//
// Loading: KV rows reach shared memory by bulk asynchronous copies (cp.async.bulk, the TMA
// engine), one 256-byte copy per key row of K and of V, into STAGES tile buffers each with
// an mbarrier counting the bytes in flight. Warp 0 issues; the bytes in flight are bounded by
// shared memory, not by registers (the first version of this kernel streamed through
// registers and was limited by them). A stage is refilled once every warp has read it.
// Rows are padded in shared memory (kKStride, kVStride) so the MMA operand loads below are
// free of bank conflicts.
//
// Each warp takes 16 keys of a tile and runs tensor-core MMAs (m16n8k16, fp32 accumulate):
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

#include "decode_mma.cuh"

namespace cg = cooperative_groups;

namespace {

using namespace tandem_decode;

// Shared-memory row pitches. K is read as rows g, g + 1 at column 16c bytes per quarter warp
// (pitch 80 words: rows 16 banks apart), V as rows 2c (+1) at column 16g bytes (pitch 68
// words: rows 8 banks apart), so neither MMA operand load has a bank conflict.
constexpr int kKStride = kRowBytes + 64;
constexpr int kVStride = kRowBytes + 16;

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

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronous (cp.async, L2 only); `fill` false writes zeros and
// reads nothing. Completion is per thread, by commit groups (async_commit / async_wait).
__device__ __forceinline__ void async_copy16(void* dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(dst)),
               "l"(src), "r"(fill ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int PENDING>  // wait until at most PENDING of this thread's groups are in flight
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

template <typename T, int G, int WARPS, int STAGES>
struct DecodeCta {
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kTile = WARPS * kChunk;
  static constexpr int kPieces = kRowBytes / 16;  // 16-byte copies per row
  // Rows of a tile one thread copies: thread t copies piece t % kPieces of rows
  // t / kPieces + j * kRowStep (of K and of V).
  static constexpr int kRowStep = kThreads / kPieces;
  static constexpr int kRowsPerThread = kTile / kRowStep;
  static constexpr int kStageBytes = kTile * (kKStride + kVStride);
  static constexpr int kSharedBytes = STAGES * kStageBytes;

  const Params& p;
  const int32_t* table;
  const char* k_head;  // this KV head's row in slot 0 of block 0
  const char* v_head;
  char* stages;        // dynamic shared memory: STAGES x (kTile K rows, kTile V rows)
  int lo, hi, seq_len, num_tiles, g, c;

  __device__ DecodeCta(const Params& params, char* stage_memory, int seq, int kv_head,
                       int split, int num_splits, int lane)
      : p(params), stages(stage_memory), g(lane >> 2), c(lane & 3) {
    seq_len = p.seq_lens[seq];
    const int first = p.sliding_window > 0 ? max(seq_len - p.sliding_window, 0) : 0;
    const int n = max(seq_len - first, 0);
    const int per_split = ((n + num_splits - 1) / num_splits + kTile - 1) / kTile * kTile;
    lo = first + split * per_split;
    hi = min(lo + per_split, seq_len);
    num_tiles = hi > lo ? (hi - lo + kTile - 1) / kTile : 0;
    table = p.block_tables + static_cast<int64_t>(seq) * p.table_stride;
    k_head = static_cast<const char*>(p.k_cache) + kv_head * p.k_stride_head * sizeof(T);
    v_head = static_cast<const char*>(p.v_cache) + kv_head * p.v_stride_head * sizeof(T);
  }

  __device__ __forceinline__ char* k_rows(int stage) const { return stages + stage * kStageBytes; }
  __device__ __forceinline__ char* v_rows(int stage) const {
    return k_rows(stage) + kTile * kKStride;
  }

  // Block ids of the rows this thread copies in tile `tile` (0 past the range).
  __device__ __forceinline__ void load_ids(int tile, int (&ids)[kRowsPerThread]) const {
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int pos = lo + tile * kTile + threadIdx.x / kPieces + j * kRowStep;
      ids[j] = pos < hi ? __ldg(table + pos / p.block_size) : 0;
    }
  }

  // This thread's pieces of tile `tile` into its stage; rows past the range become zeros.
  // The newest key is copied only if `newest` says so (kSkip before the PDL wait, kOnly
  // after it for the pieces skipped then).
  enum Newest { kSkip, kOnly, kWith };
  __device__ __forceinline__ void issue(int tile, const int (&ids)[kRowsPerThread],
                                        Newest newest) const {
    const int stage = tile % STAGES, start = lo + tile * kTile;
    const int piece = (threadIdx.x % kPieces) * 16;
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int row = threadIdx.x / kPieces + j * kRowStep, pos = start + row;
      const bool is_newest = pos == seq_len - 1;
      if ((newest == kSkip && is_newest) || (newest == kOnly && !is_newest)) continue;
      const bool in = pos < hi;
      const int64_t block = ids[j], slot = in ? pos % p.block_size : 0;
      async_copy16(k_rows(stage) + row * kKStride + piece,
                   k_head + (block * p.k_stride_block + slot * p.k_stride_slot) * sizeof(T) +
                       piece, in);
      async_copy16(v_rows(stage) + row * kVStride + piece,
                   v_head + (block * p.v_stride_block + slot * p.v_stride_slot) * sizeof(T) +
                       piece, in);
    }
  }

  // This warp's 16 keys of tile `tile` (rows `mine`..) from shared memory into MMA operand
  // registers; rows past the range hold zeros (issue).
  __device__ __forceinline__ void load_chunk(int tile, int mine, Chunk& ch) const {
    const int stage = tile % STAGES;
    tandem_decode::load_chunk(k_rows(stage) + mine * kKStride, kKStride,
                              v_rows(stage) + mine * kVStride, kVStride, g, c, ch);
  }
};

template <typename T, int G, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, 1) decode_cluster_kernel(const Params p) {
  using Cta = DecodeCta<T, G, WARPS, STAGES>;
  constexpr int kThreads = WARPS * 32;
  extern __shared__ __align__(128) char stage_memory[];
  __shared__ float warp_m[WARPS][G], warp_l[WARPS][G];
  __shared__ float warp_acc[WARPS][G][kHeadDim];
  __shared__ float cta_m[G], cta_l[G];  // read by the whole cluster
  __shared__ float cta_o[G][kHeadDim];

  cg::cluster_group cluster = cg::this_cluster();
  const int num_splits = gridDim.x;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Cta cta(p, stage_memory, seq, kv_head, blockIdx.x, num_splits, lane);
  const int mine = warp * kChunk;  // this warp's rows within each tile

  // Tables are filled at least two kernels earlier (attention_gpu.py): safe before the wait.
  // Commit groups, the same sequence in every thread (some empty): tiles 0..STAGES-1, the
  // newest key, then one refill per consumed tile.
  int ids[STAGES][Cta::kRowsPerThread];
#pragma unroll
  for (int s = 0; s < STAGES; ++s) cta.load_ids(s, ids[s]);
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    if (s < cta.num_tiles) cta.issue(s, ids[s], Cta::kSkip);
    async_commit();
  }

  wait_for_previous_kernel();  // q and this step's newest key come from earlier kernels

#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (s < cta.num_tiles) cta.issue(s, ids[s], Cta::kOnly);
  async_commit();
  uint4 q[4];
  load_q<T, G>(static_cast<const T*>(p.q) + seq * p.q_stride_tok + kv_head * G * p.q_stride_head,
               p.q_stride_head, cta.g, cta.c, q);
  const float q_scale = p.scale * kLog2e;

  float m = -INFINITY, l = 0.f, acc[8][4];
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  int next_ids[Cta::kRowsPerThread];  // ids of the next tile to refill a stage with
  if (STAGES < cta.num_tiles) cta.load_ids(STAGES, next_ids);
  for (int tile = 0; tile < cta.num_tiles; ++tile) {
    // Groups committed so far: STAGES + 1 + tile. At most STAGES - 1 pending leaves tile
    // `tile`'s group landed; the last tile waits for everything (the newest key's group).
    if (tile + 1 < cta.num_tiles)
      async_wait<STAGES - 1>();
    else
      async_wait<0>();
    __syncthreads();  // every thread's pieces of this tile have landed
    Chunk ch;
    cta.load_chunk(tile, mine, ch);
    attend<T>(cta.lo + tile * Cta::kTile + mine, cta.lo, cta.hi, cta.g, cta.c, ch, q, q_scale, m,
              l, acc);
    const int refill = tile + STAGES;
    __syncthreads();  // every warp has read this stage
    if (refill < cta.num_tiles) {
      cta.issue(refill, next_ids, Cta::kWith);
      if (refill + 1 < cta.num_tiles) cta.load_ids(refill + 1, next_ids);
    }
    async_commit();
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

struct Kernel {
  void (*fn)(const Params);
  int shared_bytes;  // dynamic shared memory: the stage buffers
};

template <typename T, int G, int WARPS, int STAGES>
Kernel kernel_of() {
  return {decode_cluster_kernel<T, G, WARPS, STAGES>,
          DecodeCta<T, G, WARPS, STAGES>::kSharedBytes};
}

// The built (warps, stages) shapes; cluster_decode.py's SHAPES lists the same.
template <typename T, int G>
Kernel pick_shape(int warps, int stages) {
  if (warps == 4 && stages == 2) return kernel_of<T, G, 4, 2>();
  if (warps == 4 && stages == 4) return kernel_of<T, G, 4, 4>();
  if (warps == 8 && stages == 1) return kernel_of<T, G, 8, 1>();
  return {nullptr, 0};
}

template <typename T>
Kernel pick_group(int group, int warps, int stages) {
  switch (group) {
    case 1: return pick_shape<T, 1>(warps, stages);
    case 2: return pick_shape<T, 2>(warps, stages);
    case 4: return pick_shape<T, 4>(warps, stages);
    case 8: return pick_shape<T, 8>(warps, stages);
    default: return {nullptr, 0};
  }
}

Kernel pick_kernel(int dtype, int group, int warps, int stages) {
  if (dtype == 0) return pick_group<__nv_bfloat16>(group, warps, stages);
  if (dtype == 1) return pick_group<__half>(group, warps, stages);
  return {nullptr, 0};
}

cudaLaunchConfig_t cluster_config(const Kernel& kernel, int warps, int num_splits,
                                  int num_kv_heads, int num_seqs, cudaLaunchAttribute* attrs) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_splits, num_kv_heads, num_seqs);
  config.blockDim = dim3(warps * 32, 1, 1);
  config.dynamicSmemBytes = kernel.shared_bytes;
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = num_splits;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  config.attrs = attrs;
  config.numAttrs = 1;
  return config;
}

cudaError_t prepare(const Kernel& kernel, int num_splits, int device) {
  // This library links its own CUDA runtime: make the caller's device current for it.
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kernel.shared_bytes);
  if (err == cudaSuccess && num_splits > 8)  // 16-CTA clusters are Hopper's non-portable max
    err = cudaFuncSetAttribute(kernel.fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return err;
}

}  // namespace

// `params` points at a Params (a void pointer keeps this symbol's linkage external).
// Returns 0 or a cudaError_t; -1 for a (dtype, group, warps, stages) that is not built.
extern "C" int tandem_decode_cluster_launch(const void* params, int dtype, int group,
                                            int warps, int stages, int num_seqs,
                                            int num_kv_heads, int num_splits, int device,
                                            void* stream, int pdl) {
  const Kernel kernel = pick_kernel(dtype, group, warps, stages);
  if (kernel.fn == nullptr) return -1;
  const cudaError_t err = prepare(kernel, num_splits, device);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t config =
      cluster_config(kernel, warps, num_splits, num_kv_heads, num_seqs, attrs);
  config.stream = static_cast<cudaStream_t>(stream);
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = pdl;
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, kernel.fn, *static_cast<const Params*>(params));
}

// How many clusters of `num_splits` CTAs can be resident at once (<0 on error).
extern "C" int tandem_decode_cluster_max_active(int dtype, int group, int warps, int stages,
                                                int num_splits, int device) {
  const Kernel kernel = pick_kernel(dtype, group, warps, stages);
  if (kernel.fn == nullptr) return -1;
  if (prepare(kernel, num_splits, device) != cudaSuccess) return -2;
  cudaLaunchAttribute attrs[1];
  const cudaLaunchConfig_t config = cluster_config(kernel, warps, num_splits, 1, 1, attrs);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel.fn, &config) != cudaSuccess) return -3;
  return clusters;
}
