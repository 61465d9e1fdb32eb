// MMA building blocks of the CUDA decode-attention kernel (decode_blocks.cu), kept apart from
// its loading and scheduling: one warp attends G query heads (G <= 8, padded to 16 MMA rows)
// of one KV head over 16 keys at a time with m16n8k16 tensor-core MMAs and an online softmax
// in log2 units. Head dim 128, 16-bit K/V/Q (bf16 or fp16), fp32 accumulation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace tandem_decode {

constexpr int kHeadDim = 128;
constexpr int kChunk = 16;  // keys one warp takes per MMA step
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRowBytes = kHeadDim * 2;  // one key's K (or V) row of one KV head, 16-bit

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

// PDL: the previous kernel has completed and its writes are visible. (The split pass lets its
// dependent launch on entry, decode_blocks.cu, so no trigger follows the wait here.)
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Diagnostics: the global nanosecond timer into trace[event] when tracing (trace non-null).
constexpr int kTraceEvents = 5;
__device__ __forceinline__ void stamp(uint64_t* trace, int event) {
  if (trace == nullptr) return;
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  trace[event] = now;
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

// The chunk's operands from shared memory: K row `key` at k + key * k_pitch, V row `key` at
// v + key * v_pitch (byte pitches; rows hold the 128 dims contiguously).
__device__ __forceinline__ void load_chunk(const char* k, int k_pitch, const char* v,
                                           int v_pitch, int g, int c, Chunk& ch) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
#pragma unroll
    for (int s = 0; s < 4; ++s)
      ch.k[u][s] = *reinterpret_cast<const uint4*>(k + (8 * u + g) * k_pitch +
                                                   (32 * s + 8 * c) * 2);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const char* row = v + (2 * c + (i & 1) + 8 * (i >> 1)) * v_pitch;
    ch.v_lo[i] = *reinterpret_cast<const uint4*>(row + 16 * g);
    ch.v_hi[i] = *reinterpret_cast<const uint4*>(row + 128 + 16 * g);
  }
}

// Lane (g, c)'s A operand of the score MMAs: query row g (zeros for padding rows g >= G),
// dims 32d + 8c .. +8 (the kDims permutation). `row0` is the group's first query row.
template <typename T, int G>
__device__ __forceinline__ void load_q(const T* row0, int64_t head_stride, int g, int c,
                                       uint4 (&q)[4]) {
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    q[d] = make_uint4(0, 0, 0, 0);
    if (g < G)
      q[d] = __ldcg(reinterpret_cast<const uint4*>(row0 + g * head_stride + 32 * d + 8 * c));
  }
}

// One online-softmax step over the 16 keys at `start` (keys outside [lo, hi) masked), for
// lane (g, c). m: running max of head g (log2 units, the same in the 4 lanes of g); l: this
// lane's share of head g's running sum; acc[t]: O^T rows (g, t) and (g + 8, t) for heads 2c
// and 2c + 1 (MMA accumulator layout). q: this lane's rows of Q (load_q).
template <typename T>
__device__ __forceinline__ void attend(int start, int lo, int hi, int g, int c, const Chunk& ch,
                                       const uint4 (&q)[4], float q_scale, float& m, float& l,
                                       float (&acc)[8][4]) {
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
      const int pos = start + 8 * u + 2 * c + e;
      const bool visible = pos >= lo && pos < hi;
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

}  // namespace tandem_decode
