// The second pass of a split-KV decode pair in CUDA: for each (sequence, query head)
//   out = sum_s exp(lse_s - m) o_s / (sum_s exp(lse_s - m) + exp(sink - m)),
//   m = max(lse_1..S, sink)
// the exact softmax over every split's keys (plus the sink logit, if any), as
// paged_decode.py's Triton combine computes it. This one exists beside it because it needs
// ~1 KB of shared memory: the next call's split pass (decode_blocks.cu), which takes nearly all
// of an SM's shared memory, can then be resident next to it and stream its KV while it runs.
// It also lets the next kernel launch at once (griddepcontrol.launch_dependents before its own
// wait): that kernel waits for this one before reading anything this one writes.
//
// Grid (num_seqs, num_heads, 128 / kCombineDims), kCombineThreads threads: thread t reads the
// float4 of columns 4 (t % 8) of splits t / 8, t / 8 + 32, ... (every load issued before any
// is used), and the rows are summed through shuffles and shared memory.
#pragma once

#include <stdint.h>

#include "decode_mma.cuh"  // kHeadDim, from_float, stamp

namespace tandem_decode {

struct CombineParams {
  const float* part_out;  // [num_seqs, num_heads, num_splits, 128]
  const float* part_lse;  // [num_seqs, num_heads, num_splits], natural log
  const float* sinks;     // [num_heads] or null
  void* out;              // [num_seqs, num_heads, 128] of T, last dim contiguous
  int64_t out_stride_tok, out_stride_head;
  int32_t num_splits;     // <= kCombineMaxSplits
  uint64_t* trace;        // diagnostics, normally null: per CTA entry, wait returned, end
};

constexpr int kCombineThreads = 256;
constexpr int kCombineDims = 32;                                  // columns per CTA
constexpr int kCombineRows = kCombineThreads / (kCombineDims / 4);  // splits read at once: 32
constexpr int kCombineMaxSplits = 8 * kCombineRows;                 // 8 loads per thread
constexpr int kCombineWarps = kCombineThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) combine_splits_kernel(const CombineParams p) {
  const int cta = (blockIdx.x * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z;
  uint64_t* trace = p.trace != nullptr && threadIdx.x == 0 ? p.trace + cta * kTraceEvents : nullptr;
  stamp(trace, 0);
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the partials come from the split pass
  stamp(trace, 1);
  __shared__ float warp_max[kCombineWarps], warp_sum[kCombineWarps];
  __shared__ float4 warp_acc[kCombineWarps][kCombineDims / 4];
  const int seq = blockIdx.x, head = blockIdx.y, num_heads = gridDim.y;
  const int column = threadIdx.x % (kCombineDims / 4), first_row = threadIdx.x / (kCombineDims / 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = (static_cast<int64_t>(seq) * num_heads + head) * p.num_splits;
  const int dim = blockIdx.z * kCombineDims + 4 * column;

  float lse[8];
  float4 part[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int s = first_row + i * kCombineRows;
    lse[i] = s < p.num_splits ? p.part_lse[row0 + s] : -INFINITY;
    part[i] = s < p.num_splits
                  ? *reinterpret_cast<const float4*>(p.part_out + (row0 + s) * kHeadDim + dim)
                  : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, lse[i]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  const float sink = p.sinks != nullptr ? p.sinks[head] : -INFINITY;
  m = sink;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) m = fmaxf(m, warp_max[w]);
  if (m == -INFINITY) m = 0.f;  // no keys at all (a 0-length row): every weight is 0

  float sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float w = __expf(lse[i] - m);  // empty splits: exp(-inf) = 0, and their o is 0
    sum += w;
    acc.x += w * part[i].x;
    acc.y += w * part[i].y;
    acc.z += w * part[i].z;
    acc.w += w * part[i].w;
  }
  // Lanes l, l + 8, l + 16, l + 24 hold the same columns for different splits.
#pragma unroll
  for (int offset = 8; offset < 32; offset *= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    acc.x += __shfl_xor_sync(0xffffffffu, acc.x, offset);
    acc.y += __shfl_xor_sync(0xffffffffu, acc.y, offset);
    acc.z += __shfl_xor_sync(0xffffffffu, acc.z, offset);
    acc.w += __shfl_xor_sync(0xffffffffu, acc.w, offset);
  }
  if (lane < kCombineDims / 4) warp_acc[warp][lane] = acc;
  if (lane == 0) warp_sum[warp] = sum;
  __syncthreads();
  if (threadIdx.x >= kCombineDims / 4) return;
  float denom = __expf(sink - m);  // 0 without a sink
  float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) {
    denom += warp_sum[w];
    total.x += warp_acc[w][threadIdx.x].x;
    total.y += warp_acc[w][threadIdx.x].y;
    total.z += warp_acc[w][threadIdx.x].z;
    total.w += warp_acc[w][threadIdx.x].w;
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  T* out = static_cast<T*>(p.out) + seq * p.out_stride_tok + head * p.out_stride_head + dim;
  out[0] = from_float(total.x * inv, T());
  out[1] = from_float(total.y * inv, T());
  out[2] = from_float(total.z * inv, T());
  out[3] = from_float(total.w * inv, T());
  stamp(trace, 2);
}

}  // namespace tandem_decode
