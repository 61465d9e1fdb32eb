// The step's QK norm and RoPE inside the decode-attention kernel (decode_blocks.cu): the same
// function as gpu/rope.py's kernel, applied to rows the attending warps already hold in
// registers, so a decode layer needs no launch of its own between the qkv projection and the
// attention.
//
// Arithmetic as rope.py (and so as norm.RMSNorm then rotary.RotaryEmbedding): the per-head
// RMSNorm normalises in fp32, rounds to the activation dtype, multiplies by the weight and
// rounds again; the rotation reads those rounded values, computes in fp32 and rounds once.
// Full rotary over 128 dims only (the caller checks): every dim is in one rotated pair, so
// the pairs' sums of squares are the head's. Pairs: neox (i, i + 64) or GPT-J (2i, 2i + 1);
// cos / sin tables [max_position, 64] fp32, already scaled by the attention factor.
//
// Two layouts of a 128-dim row across a warp, each lane holding 8-dim slices as uint4s:
//   query rows  lane (g, c) holds dims 32d + 8c .. +8 of head g, d = 0..3 (load_q's layout):
//               a head spans the 4 lanes of g, and neox partners (d, d + 2) share a lane;
//   a new key   lane l < 16 holds dims 8l .. +8 of the K row (lanes 16..31 hold V, which is
//               not rotated): neox partners sit in lanes l and l ^ 8.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "decode_mma.cuh"  // pack, from_float

namespace tandem_decode {

enum RopeStyle : int32_t { kRopeNone = 0, kRopeNeox = 1, kRopeGptj = 2 };

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float(x, T()));
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&x)[8]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = to_float(e[j]);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  return make_uint4(pack(x[0], x[1], T()), pack(x[2], x[3], T()), pack(x[4], x[5], T()),
                    pack(x[6], x[7], T()));
}

// x <- round(w * round(x * inv)), norm.RMSNorm's rounding.
template <typename T>
__device__ __forceinline__ void scale_by_norm(float (&x)[8], float inv, const uint4& weight) {
  float w[8];
  unpack8<T>(weight, w);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = round_to<T>(w[j] * round_to<T>(x[j] * inv));
}

__device__ __forceinline__ float sum_squares(const float (&x)[8]) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += x[j] * x[j];
  return s;
}

// (a, b) <- (round(a cos - b sin), round(b cos + a sin)): one rotated pair.
template <typename T>
__device__ __forceinline__ void rotate_pair(float& a, float& b, float cos, float sin) {
  const float a2 = a * cos - b * sin, b2 = b * cos + a * sin;
  a = round_to<T>(a2);
  b = round_to<T>(b2);
}

// Lane (g, c)'s cos / sin for its query dims (16 each): neox dims 32d + 8c + j use entry
// 32 (d % 2) + 8c + j, stored at [8 (d % 2) + j]; GPT-J's pair (2i, 2i + 1) uses entry i,
// stored at [4d + j / 2].
struct QueryRope {
  float cos[16], sin[16];
  uint4 weight[4];  // the q norm's weights for the lane's dims, when there is a norm

  template <typename T>
  __device__ __forceinline__ void load(const float* cos_row, const float* sin_row,
                                       const T* norm_weight, int style, int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int entry = style == kRopeNeox ? 32 * h + 8 * c + j : 16 * (2 * h + j / 4) +
                                                                         4 * c + j % 4;
        cos[8 * h + j] = cos_row[entry];
        sin[8 * h + j] = sin_row[entry];
      }
    }
#pragma unroll
    for (int d = 0; d < 4; ++d)
      weight[d] = norm_weight != nullptr
                      ? __ldg(reinterpret_cast<const uint4*>(norm_weight + 32 * d + 8 * c))
                      : make_uint4(0, 0, 0, 0);
  }

  // q[d]: dims 32d + 8c .. +8 of one head, normed (with a weight) and rotated in place. The
  // 4 lanes of a head must call this together (the norm's sum is shuffled between them).
  template <typename T>
  __device__ __forceinline__ void apply(uint4 (&q)[4], int style, bool norm, float eps) const {
    float x[4][8];
#pragma unroll
    for (int d = 0; d < 4; ++d) unpack8<T>(q[d], x[d]);
    if (norm) {
      float s = sum_squares(x[0]) + sum_squares(x[1]) + sum_squares(x[2]) + sum_squares(x[3]);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      const float inv = rsqrtf(s / kHeadDim + eps);
#pragma unroll
      for (int d = 0; d < 4; ++d) scale_by_norm<T>(x[d], inv, weight[d]);
    }
    if (style == kRopeNeox) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 8; ++j) rotate_pair<T>(x[h][j], x[h + 2][j], cos[8 * h + j],
                                                   sin[8 * h + j]);
      }
    } else {
#pragma unroll
      for (int d = 0; d < 4; ++d) {
#pragma unroll
        for (int j = 0; j < 8; j += 2) rotate_pair<T>(x[d][j], x[d][j + 1], cos[4 * d + j / 2],
                                                      sin[4 * d + j / 2]);
      }
    }
#pragma unroll
    for (int d = 0; d < 4; ++d) q[d] = pack8<T>(x[d]);
  }
};

// Lane l < 16's cos / sin for dims 8l .. +8 of a new key: neox entry 8 (l % 8) + j, GPT-J's
// pair (2i, 2i + 1) entry i, stored at [j / 2].
struct KeyRope {
  float cos[8], sin[8];
  uint4 weight;  // the k norm's weights for the lane's dims, when there is a norm

  template <typename T>
  __device__ __forceinline__ void load(const float* cos_row, const float* sin_row,
                                       const T* norm_weight, int style, int lane) {
    const int l = lane % 16;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int entry = style == kRopeNeox ? 8 * (l % 8) + j : 4 * l + j / 2;
      cos[j] = cos_row[entry];
      sin[j] = sin_row[entry];
    }
    weight = norm_weight != nullptr
                 ? __ldg(reinterpret_cast<const uint4*>(norm_weight + 8 * l))
                 : make_uint4(0, 0, 0, 0);
  }

  // row: lanes 0..15 the K row's slices (normed and rotated here), lanes 16..31 V's (left as
  // they are). The whole warp calls this (shuffles).
  template <typename T>
  __device__ __forceinline__ void apply(uint4& row, int style, bool norm, float eps,
                                        int lane) const {
    float x[8];
    unpack8<T>(row, x);
    if (norm) {
      float s = sum_squares(x);
#pragma unroll
      for (int offset = 1; offset < 16; offset *= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane < 16) scale_by_norm<T>(x, rsqrtf(s / kHeadDim + eps), weight);
    }
    if (style == kRopeNeox) {
      float partner[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) partner[j] = __shfl_xor_sync(0xffffffffu, x[j], 8);
      if (lane < 16) {
        // lanes 0..7 hold the pairs' first halves (dims < 64), lanes 8..15 the second
        const float sign = lane < 8 ? -1.f : 1.f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          x[j] = round_to<T>(x[j] * cos[j] + sign * partner[j] * sin[j]);
      }
    } else if (lane < 16) {
#pragma unroll
      for (int j = 0; j < 8; j += 2) rotate_pair<T>(x[j], x[j + 1], cos[j], sin[j]);
    }
    if (lane < 16) row = pack8<T>(x);
  }
};

}  // namespace tandem_decode
