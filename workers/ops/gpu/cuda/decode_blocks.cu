// Split-KV paged decode attention whose CTAs read whole cache blocks, then the combine
// (decode_combine.cuh): the engine's decode attention for 1-8 sequences on Hopper
// (ops/attention_gpu.py), where every byte of KV must stream at close to copy bandwidth.
//
// Why: a cache block holds block_size slots x every KV head, contiguous (kv_cache layout
// [num_blocks, block_size, kv_heads, 128]), so one slot of K is kv_heads x 256 bytes in one
// piece. Here a CTA takes whole blocks of one sequence and every KV head (warp h attends KV
// head h) and moves each slot with one bulk asynchronous copy (cp.async.bulk, the TMA engine)
// into shared memory. The Triton split kernel (paged_decode.py) gathers one KV head's
// 256-byte rows into registers instead, which bounds its bytes in flight per SM.
// One CTA per SM (its buffers take ~200 KB of shared memory), so a call's CTAs start as the
// previous call's exit; the producer warp issues the slot copies as the TMA engine accepts
// them, and the attending warps start on a block as soon as it lands. Times, the timeline
// (bench/probes/block_decode.py --timeline) and the stream-only floor
// (bench/probes/hbm_stream_probe.cu) are on bench/RESULTS.md.
//
// Grid (num_splits, num_seqs), KV + 1 warps per CTA: warps 0..KV-1 attend, warp KV (the
// producer) only moves blocks. CTA s of a sequence takes blocks s, s + num_splits,
// s + 2 num_splits, ... of its visible range (whole blocks; keys outside [first, seq_len) are
// masked, first = seq_len - window with a sliding window). Strided, so without a window the
// first ids are known before seq_len is: both loads go out together.
// Blocks pass through `stages` buffers of one block each, each with a `full` mbarrier counting
// the bytes in flight and an `empty` one that every attending warp arrives on once it has read
// the buffer, before the producer refills it. The producer's copies are back-pressured by the
// TMA engine (~4 us to issue a CTA's 64 slot copies at 1 x 4k), so the attending warps must
// not be the ones issuing: they start on block 0 as soon as it lands. Slots past the sequence
// are zeroed instead of copied (their V must not be NaN garbage: 0 x NaN = NaN in the MMA).
// Shared rows are padded (kKPitch, kVPitch) so decode_mma.cuh's operand loads are free of
// bank conflicts: K rows g, g + 1 land 64 bytes apart modulo 128, V rows 2c 32 bytes apart.
// Output per (sequence, query head, split): o = sum p v / sum p [128] fp32 and
// lse = log sum exp(score) (natural log), which the combine reads; an empty split writes
// lse = -inf and o = 0.
// The newest key's slot is never copied: the attending warps of the CTA whose run holds it
// load its K / V rows with plain loads after their PDL wait (rather than queueing them behind
// the TMA's backlog) and put them into the buffer once the block's other slots have landed.
// Those rows come either from the cache, where a RoPE + KV-write kernel put them, or (Params
// `rope`) from the qkv projection's output: this launch then normalises and rotates q and
// the new K itself and writes the new rows to the cache (decode_rope.cuh), one launch fewer
// per decode layer.
// PDL: the producer requests the first `stages` blocks before griddepcontrol.wait (invariant,
// as in paged_decode.py: a decode step's KV write touches only each sequence's newest row,
// which no copy reads); q, the newest rows, every refill and every store come after the wait.
// The step's positions, slots, tables and the RoPE tables are read before it (written before
// the step's first kernel). Every CTA lets the dependent grid (this pair's combine) launch on
// entry: the combine reads nothing before its own wait for this kernel, and its own early
// launch lets the kernel after it (the o_proj GEMV at batch 1) start on its weights while this
// kernel still runs, rather than only once this kernel's wait has returned.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "decode_combine.cuh"
#include "decode_mma.cuh"
#include "decode_rope.cuh"

namespace {

using namespace tandem_decode;

// Shared-memory mbarriers and bulk (TMA) copies, sm_90+: thin wrappers over the PTX. A buffer's
// `full` barrier counts the bytes of the copies into it; an `empty` one counts the warps that
// have read it.
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A phase completes after `count` arrivals (and every byte an arrival expects has landed).
__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count)
               : "memory");
}

// The phase's one arrival, announcing `bytes` of bulk copies to wait for.
__device__ __forceinline__ void barrier_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   smem_address(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}

// `bytes` global -> this CTA's shared memory through the TMA engine, counted on `bar`.
// Both addresses 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar))
      : "memory");
}

// Arrive once on `bar` (the consumer's release of a buffer).
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

constexpr int kMaxStages = 8;
constexpr float kLn2 = 0.6931471805599453f;

struct Params {  // mirrored by block_decode.py's ctypes structure: keep the order
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float* part_out;  // [num_seqs, num_heads, num_splits, 128]
  float* part_lse;  // [num_seqs, num_heads, num_splits]
  int64_t q_stride_tok, q_stride_head;
  int64_t k_stride_block, v_stride_block;  // elements; slots and heads are contiguous
  int64_t table_stride;
  int32_t table_width;     // block ids per table row
  int32_t block_size;      // a multiple of 16
  int32_t sliding_window;  // 0: none
  int32_t stages;          // block buffers in shared memory, <= kMaxStages
  int32_t padded;          // 1: padded slot pitches, one copy per slot; 0: one copy per block
  float scale;             // softmax scale (natural units)
  // Diagnostics (bench/probes/block_decode.py --timeline), normally null: per CTA the
  // %globaltimer (ns) at entry, copies issued, PDL wait returned, last block landed, partials
  // stored.
  uint64_t* trace;
  // rope != kRopeNone: this launch also does the step's QK norm (with q_norm / k_norm), RoPE
  // and KV write (decode_rope.cuh), so q is the projection's raw output and the new K / V
  // rows are k_new / v_new [num_seqs, KV, 128]; the CTA holding a sequence's newest slot
  // writes them (K rotated) to the cache at slot_mapping[seq] (none for a padding row,
  // slot < 0). kRopeNone: q is rotated and the new rows are in the cache already.
  const void* k_new;
  const void* v_new;
  const int64_t* positions;     // [num_seqs]
  const int64_t* slot_mapping;  // [num_seqs]
  const float* cos;             // [max_position, 64] fp32, rows rope_stride apart
  const float* sin;
  const void* q_norm;  // [128] per-head RMSNorm weights of q, or null (no QK norm)
  const void* k_norm;
  int64_t k_new_stride_tok, k_new_stride_head, v_new_stride_tok, v_new_stride_head;
  int64_t rope_stride;
  int32_t rope;  // RopeStyle
  float norm_eps;
};

template <int KV>
struct Layout {
  static constexpr int kSlotBytes = KV * kRowBytes;  // one slot of K (or V): every KV head
  static constexpr int kKPitch = kSlotBytes + 64;
  static constexpr int kVPitch = kSlotBytes + 16;
};

template <typename T, int KV>
struct BlockRun {
  using L = Layout<KV>;
  const Params& p;
  char* buffers;   // dynamic shared memory: `stages` x (block_size K slots, then V slots)
  uint64_t* full;  // [stages]: the buffer's copied bytes have landed
  int seq_len, first, first_block, split, num_splits, n, stage_bytes;
  int k_pitch, v_pitch;  // bytes between slots in a buffer

  __device__ BlockRun(const Params& params, char* memory, uint64_t* barriers, int seq,
                      int split_index, int splits)
      : p(params), buffers(memory), full(barriers), split(split_index), num_splits(splits) {
    seq_len = p.seq_lens[seq];
    first = p.sliding_window > 0 ? max(seq_len - p.sliding_window, 0) : 0;
    first_block = first / p.block_size;
    const int end_block = (seq_len + p.block_size - 1) / p.block_size;
    n = max(end_block - first_block - split + num_splits - 1, 0) / num_splits;
    k_pitch = p.padded ? L::kKPitch : L::kSlotBytes;
    v_pitch = p.padded ? L::kVPitch : L::kSlotBytes;
    stage_bytes = p.block_size * (k_pitch + v_pitch);
  }

  // The block index (in the sequence) of the run's i-th block.
  __device__ __forceinline__ int block(int i) const {
    return first_block + split + i * num_splits;
  }

  __device__ __forceinline__ char* k_slots(int i) const {
    return buffers + (i % p.stages) * stage_bytes;
  }
  __device__ __forceinline__ char* v_slots(int i) const {
    return k_slots(i) + p.block_size * k_pitch;
  }

  // The run index of the block holding the newest key, or -1 when another CTA's run holds it.
  __device__ __forceinline__ int newest_index() const {
    if (seq_len == 0) return -1;
    const int offset = (seq_len - 1) / p.block_size - first_block - split;
    return offset >= 0 && offset % num_splits == 0 ? offset / num_splits : -1;
  }

  // The producer warp: block i of the run (cache block `id`) into its buffer. Zeroes the
  // slots past the sequence, arms the buffer's barrier, then copies every slot before them
  // except the newest key's, which the attending warps put in themselves (put_newest).
  __device__ __forceinline__ void issue(int i, int64_t id, int lane) const {
    uint64_t* bar = &full[i % p.stages];
    const int base = block(i) * p.block_size;
    const int valid = min(max(seq_len - base, 0), p.block_size);
    constexpr int kVectors = L::kSlotBytes / 16;
    for (int v = lane; v < (p.block_size - valid) * kVectors; v += 32) {
      const int slot = valid + v / kVectors, offset = (v % kVectors) * 16;
      *reinterpret_cast<uint4*>(k_slots(i) + slot * k_pitch + offset) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(v_slots(i) + slot * v_pitch + offset) = make_uint4(0, 0, 0, 0);
    }
    const bool holds_newest = valid > 0 && base + valid == seq_len;
    const int to = holds_newest ? valid - 1 : valid;  // slots to copy
    __syncwarp();
    if (lane == 0) barrier_expect(bar, to * 2 * L::kSlotBytes);
    __syncwarp();
    const char* k_block = static_cast<const char*>(p.k_cache) + id * p.k_stride_block * sizeof(T);
    const char* v_block = static_cast<const char*>(p.v_cache) + id * p.v_stride_block * sizeof(T);
    if (p.padded) {  // one copy per slot, each to its padded row
      for (int slot = lane; slot < to; slot += 32) {
        bulk_copy(k_slots(i) + slot * k_pitch, k_block + slot * L::kSlotBytes, L::kSlotBytes,
                  bar);
        bulk_copy(v_slots(i) + slot * v_pitch, v_block + slot * L::kSlotBytes, L::kSlotBytes,
                  bar);
      }
    } else if (lane == 0 && to > 0) {  // the slots are contiguous in the cache and here
      bulk_copy(k_slots(i), k_block, to * L::kSlotBytes, bar);
      bulk_copy(v_slots(i), v_block, to * L::kSlotBytes, bar);
    }
  }

  // An attending warp's slice of its KV head's newest K / V rows (lanes 0..15 K, 16..31 V,
  // 16 bytes each), loaded after the PDL wait: without RoPE here, from the cache (block i of
  // the run, cache block `id`), where the previous kernel wrote them; with it, this step's raw
  // k_new / v_new rows, for cache_newest.
  __device__ __forceinline__ uint4 load_newest(int i, int64_t id, int seq, int head,
                                               int lane) const {
    const int part = lane % 16;
    if (p.rope == kRopeNone) {
      const int in_block = seq_len - 1 - block(i) * p.block_size;
      const int64_t stride = lane < 16 ? p.k_stride_block : p.v_stride_block;
      const char* cache = static_cast<const char*>(lane < 16 ? p.k_cache : p.v_cache);
      return __ldcg(reinterpret_cast<const uint4*>(
          cache + (id * stride * sizeof(T) + in_block * L::kSlotBytes + head * kRowBytes) +
          part * 16));
    }
    const T* src = lane < 16
        ? static_cast<const T*>(p.k_new) + seq * p.k_new_stride_tok + head * p.k_new_stride_head
        : static_cast<const T*>(p.v_new) + seq * p.v_new_stride_tok + head * p.v_new_stride_head;
    return __ldcg(reinterpret_cast<const uint4*>(src + part * 8));
  }

  // With RoPE here: the raw newest rows (load_newest) normed and rotated (K only) in place,
  // then stored to the cache at `slot` unless it is a padding row's (< 0). The whole warp
  // calls this (shuffles).
  __device__ __forceinline__ void cache_newest(uint4& row, int head, int lane,
                                               const KeyRope& rope, int64_t slot) const {
    rope.apply<T>(row, p.rope, p.k_norm != nullptr, p.norm_eps, lane);
    if (slot < 0) return;
    const int64_t stride = lane < 16 ? p.k_stride_block : p.v_stride_block;
    char* cache = static_cast<char*>(const_cast<void*>(lane < 16 ? p.k_cache : p.v_cache));
    *reinterpret_cast<uint4*>(cache + (slot / p.block_size) * stride * sizeof(T) +
                              (slot % p.block_size) * L::kSlotBytes + head * kRowBytes +
                              (lane % 16) * 16) = row;
  }

  // The newest key's row slice (load_newest) into block i's buffer, once its copies landed.
  __device__ __forceinline__ void put_newest(int i, int head, int lane, const uint4& row) const {
    const int slot = seq_len - 1 - block(i) * p.block_size;
    char* dst = lane < 16 ? k_slots(i) + slot * k_pitch : v_slots(i) + slot * v_pitch;
    *reinterpret_cast<uint4*>(dst + head * kRowBytes + (lane % 16) * 16) = row;
    __syncwarp();
  }
};

// Warps 0..KV-1 attend (warp h: KV head h); warp KV only moves blocks into the buffers.
template <typename T, int G, int KV>
__global__ void __launch_bounds__((KV + 1) * 32, 1) decode_blocks_kernel(const Params p) {
  using Run = BlockRun<T, KV>;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the combine (above)
  extern __shared__ __align__(128) char buffers[];
  __shared__ __align__(8) uint64_t full[kMaxStages];   // the buffer's copies have landed
  __shared__ __align__(8) uint64_t empty[kMaxStages];  // every attending warp has read it
  const int split = blockIdx.x, num_splits = gridDim.x, seq = blockIdx.y;
  const int head = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const bool producer = head == KV;
  uint64_t* trace = p.trace != nullptr && (threadIdx.x == 0 || (producer && lane == 0))
                        ? p.trace + (static_cast<int64_t>(seq) * num_splits + split) * kTraceEvents
                        : nullptr;
  // Producer lane i: the id of the run's block i (i < prefill <= kMaxStages), guessed with no
  // window (first_block 0) while seq_len loads. Tables are filled at least two kernels
  // earlier (attention_gpu.py): safe before the wait. Entries past a sequence are padding,
  // loaded but never used.
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.table_stride;
  const int guess = split + lane * num_splits;
  int id = 0;
  if (producer && lane < p.stages && guess < p.table_width) id = __ldg(table + guess);
  if (!producer) stamp(trace, 0);
  const Run run(p, buffers, full, seq, split, num_splits);
  const int prefill = min(run.n, p.stages);
  if (producer && run.first_block != 0 && lane < prefill) id = __ldg(table + run.block(lane));

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      barrier_init(&full[s], 1);    // the producer's arrival, with the bytes it expects
      barrier_init(&empty[s], KV);  // one arrival per attending warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (producer) {
    for (int i = 0; i < prefill; ++i) run.issue(i, __shfl_sync(0xffffffffu, id, i), lane);
    stamp(trace, 1);
    if (prefill == run.n) return;
    wait_for_previous_kernel();
    int next_id = __ldg(table + run.block(p.stages));
    for (int i = p.stages; i < run.n; ++i) {
      const int this_id = next_id;
      if (i + 1 < run.n) next_id = __ldg(table + run.block(i + 1));
      barrier_wait(&empty[i % p.stages], (i / p.stages - 1) & 1);
      // The attending warps' shared-memory reads (generic proxy) before the TMA's writes.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      run.issue(i, this_id, lane);
    }
    return;
  }

  // Before the wait, from the step's inputs (written before its first kernel) and constants:
  // the newest key's block (when this CTA's run holds it), its slot, and the RoPE factors.
  const int newest = run.newest_index();
  const int newest_id = newest >= 0 ? __ldg(table + run.block(newest)) : 0;
  QueryRope q_rope;
  KeyRope k_rope;
  int64_t new_slot = -1;
  if (p.rope != kRopeNone) {
    const int64_t position = __ldg(p.positions + seq);
    const float* cos_row = p.cos + position * p.rope_stride;
    const float* sin_row = p.sin + position * p.rope_stride;
    q_rope.load<T>(cos_row, sin_row, static_cast<const T*>(p.q_norm), p.rope, c);
    if (newest >= 0) {
      k_rope.load<T>(cos_row, sin_row, static_cast<const T*>(p.k_norm), p.rope, lane);
      new_slot = __ldg(p.slot_mapping + seq);
    }
  }
  wait_for_previous_kernel();  // q and this step's newest key come from earlier kernels
  stamp(trace, 2);
  // Both loads go out before either is used.
  uint4 q[4];
  load_q<T, G>(static_cast<const T*>(p.q) + seq * p.q_stride_tok + head * G * p.q_stride_head,
               p.q_stride_head, g, c, q);
  uint4 newest_row = make_uint4(0, 0, 0, 0);
  if (newest >= 0) newest_row = run.load_newest(newest, newest_id, seq, head, lane);
  if (p.rope != kRopeNone) {
    q_rope.apply<T>(q, p.rope, p.q_norm != nullptr, p.norm_eps);
    if (newest >= 0) run.cache_newest(newest_row, head, lane, k_rope, new_slot);
  }
  const float q_scale = p.scale * kLog2e;

  float m = -INFINITY, l = 0.f, acc[8][4];
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  for (int i = 0; i < run.n; ++i) {
    barrier_wait(&full[i % p.stages], (i / p.stages) & 1);
    if (i == newest) run.put_newest(i, head, lane, newest_row);
    if (i + 1 == run.n) stamp(trace, 3);
    const char* k = run.k_slots(i) + head * kRowBytes;
    const char* v = run.v_slots(i) + head * kRowBytes;
    for (int chunk = 0; chunk < p.block_size; chunk += kChunk) {
      Chunk ch;
      load_chunk(k + chunk * run.k_pitch, run.k_pitch, v + chunk * run.v_pitch, run.v_pitch, g,
                 c, ch);
      attend<T>(run.block(i) * p.block_size + chunk, run.first, run.seq_len, g, c, ch, q,
                q_scale, m, l, acc);
    }
    if (i + p.stages < run.n) {  // the producer refills this buffer with block i + stages
      __syncwarp();
      if (lane == 0) barrier_arrive(&empty[i % p.stages]);
    }
  }

  if (run.n == 0) stamp(trace, 3);
  // Partials of heads head * G + 2c + e: lane (g, c) holds dims 8g.. and 64 + 8g.. (acc).
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);  // head g's full sum, in the 4 lanes of g
  const int num_heads = KV * G;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float l_e = __shfl_sync(0xffffffffu, l, (8 * c + 4 * e) & 31);  // head 2c + e
    const int h = 2 * c + e;
    if (h < G) {
      const float inv = l_e > 0.f ? 1.f / l_e : 0.f;
      float* row = p.part_out +
                   ((static_cast<int64_t>(seq) * num_heads + head * G + h) * num_splits + split) *
                       kHeadDim;
      *reinterpret_cast<float4*>(row + 8 * g) =
          make_float4(acc[0][e] * inv, acc[1][e] * inv, acc[2][e] * inv, acc[3][e] * inv);
      *reinterpret_cast<float4*>(row + 8 * g + 4) =
          make_float4(acc[4][e] * inv, acc[5][e] * inv, acc[6][e] * inv, acc[7][e] * inv);
      *reinterpret_cast<float4*>(row + 64 + 8 * g) = make_float4(
          acc[0][2 + e] * inv, acc[1][2 + e] * inv, acc[2][2 + e] * inv, acc[3][2 + e] * inv);
      *reinterpret_cast<float4*>(row + 64 + 8 * g + 4) = make_float4(
          acc[4][2 + e] * inv, acc[5][2 + e] * inv, acc[6][2 + e] * inv, acc[7][2 + e] * inv);
    }
  }
  if (c == 0 && g < G)
    p.part_lse[(static_cast<int64_t>(seq) * num_heads + head * G + g) * num_splits + split] =
        l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
  stamp(trace, 4);
}

using KernelFn = void (*)(const Params);
using CombineFn = void (*)(const CombineParams);

template <typename T, int KV>
KernelFn pick_group(int group) {
  switch (group) {
    case 1: return decode_blocks_kernel<T, 1, KV>;
    case 2: return decode_blocks_kernel<T, 2, KV>;
    case 4: return decode_blocks_kernel<T, 4, KV>;
    case 8: return decode_blocks_kernel<T, 8, KV>;
    default: return nullptr;
  }
}

template <typename T>
KernelFn pick_heads(int kv_heads, int group) {
  switch (kv_heads) {
    case 2: return pick_group<T, 2>(group);
    case 4: return pick_group<T, 4>(group);
    case 8: return pick_group<T, 8>(group);
    default: return nullptr;
  }
}

KernelFn pick_kernel(int dtype, int kv_heads, int group) {
  if (dtype == 0) return pick_heads<__nv_bfloat16>(kv_heads, group);
  if (dtype == 1) return pick_heads<__half>(kv_heads, group);
  return nullptr;
}

cudaError_t launch(const void* kernel, void** args, dim3 grid, dim3 block, int shared_bytes,
                   cudaStream_t stream, int pdl) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = pdl;
  config.attrs = attrs;
  config.numAttrs = 1;
  return cudaLaunchKernelExC(&config, kernel, args);
}

}  // namespace

// The split pass, then the combine. `params` / `combine` point at a Params / CombineParams.
// Returns 0 or a cudaError_t; -1 for a (dtype, kv_heads, group) that is not built, -2 for a
// stage or split count out of range.
extern "C" int tandem_decode_blocks_launch(const void* params, const void* combine, int dtype,
                                           int kv_heads, int group, int num_seqs,
                                           int num_splits, int shared_bytes, int device,
                                           void* stream, int pdl) {
  const KernelFn kernel = pick_kernel(dtype, kv_heads, group);
  if (kernel == nullptr) return -1;
  const int stages = static_cast<const Params*>(params)->stages;
  if (stages < 1 || stages > kMaxStages || num_splits > kCombineMaxSplits) return -2;
  const CombineFn combine_fn =
      dtype == 0 ? combine_splits_kernel<__nv_bfloat16> : combine_splits_kernel<__half>;
  // This library links its own CUDA runtime: make the caller's device current for it.
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               shared_bytes);
  const cudaStream_t on = static_cast<cudaStream_t>(stream);
  if (err == cudaSuccess)
    err = launch(reinterpret_cast<const void*>(kernel), const_cast<void**>(&params),
                 dim3(num_splits, num_seqs, 1), dim3((kv_heads + 1) * 32, 1, 1), shared_bytes,
                 on, pdl);
  const int num_heads = kv_heads * group;
  if (err == cudaSuccess)
    err = launch(reinterpret_cast<const void*>(combine_fn), const_cast<void**>(&combine),
                 dim3(num_seqs, num_heads, kHeadDim / kCombineDims), dim3(kCombineThreads, 1, 1),
                 0, on, pdl);
  return err;
}
