// Build and run on the GPU machine: nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90
//   -o /tmp/hbm_stream_probe bench/probes/hbm_stream_probe.cu && /tmp/hbm_stream_probe
// Latest numbers: bench/RESULTS.md.
// How fast can one wave of CTAs stream 1x4k's KV (256 random 32 KB K blocks + 256 V blocks,
// 16.8 MB) from HBM, by load method? Chained launches with PDL (launch_dependents at entry,
// no wait: reads only), rotating over copies that defeat L2. Prints us per call.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include <algorithm>
#include <random>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int kBlocks = 256, kBlockBytes = 32768, kSlot = 2048, kSlots = 16;

struct P { const char* k; const char* v; const int* table; float* out; int splits; int mode; };

__device__ __forceinline__ uint32_t sa(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(b)) : "memory"); }
__device__ __forceinline__ void bar_expect(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(n)
               : "memory"); }
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t ph) {
  asm volatile("{\n.reg .pred d;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n"
               "@!d bra W;\n}\n" ::"r"(sa(b)), "r"(ph) : "memory"); }
__device__ __forceinline__ void bulk(void* dst, const void* src, uint32_t n, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2,"
               " [%3];" ::"r"(sa(dst)), "l"(src), "r"(n), "r"(sa(b)) : "memory"); }
__device__ __forceinline__ void bulk_hint(void* dst, const void* src, uint32_t n, uint64_t* b,
                                          uint64_t pol) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1], %2, [%3], %4;" ::"r"(sa(dst)), "l"(src), "r"(n), "r"(sa(b)), "l"(pol)
               : "memory"); }
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t n) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(n) : "memory"); }
__device__ __forceinline__ void ldgsts(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa(dst)), "l"(src) : "memory"); }

// Modes: 0 TMA per slot (2 KB, padded rows), 1 TMA per block (32 KB), 2 LDGSTS 16 B all threads,
// 3 ld.global.v4 to registers, 4 K by TMA slots + V by LDGSTS (warps 1..), 5 L2 prefetch of all
// then TMA per block, 6 TMA per block with evict_first, 7 TMA per slot, all lanes of all warps
// issuing (warp w: slots of block w%n), 8 TMA 8 KB pieces.
__global__ void __launch_bounds__(256, 1) stream(const P p) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) uint64_t bars[8];
  const int s = blockIdx.x, t = threadIdx.x, w = t >> 5, lane = t & 31;
  int n = (kBlocks - s + p.splits - 1) / p.splits;
  if (n > 3) n = 3;
  int ids[3];
  for (int i = 0; i < n; ++i) ids[i] = p.table[s + i * p.splits];
  const int pitch_k = kSlot + 64, pitch_v = kSlot + 16;
  const int stage = kSlots * (pitch_k + pitch_v);
  if (t == 0) { for (int i = 0; i < 8; ++i) bar_init(&bars[i]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
  __syncthreads();
  float acc = 0.f;
  const int mode = p.mode;
  if (mode == 0 || mode == 7 || mode == 4) {
    if (mode == 7) {
      for (int i = 0; i < n; ++i) if (t == 0) bar_expect(&bars[i], 2 * kBlockBytes);
      __syncthreads();
      // warp w copies block w (w < n): lane % 16 is the slot, lane / 16 picks K or V
      for (int i = w; i < n; i += 8) {
        const int slot = lane & 15; const bool isv = lane >= 16;
        const char* src = (isv ? p.v : p.k) + (int64_t)ids[i] * kBlockBytes + slot * kSlot;
        char* dst = sm + i * stage + (isv ? kSlots * pitch_k + slot * pitch_v : slot * pitch_k);
        bulk(dst, src, kSlot, &bars[i]);
      }
    } else if (w == 0) {
      for (int i = 0; i < n; ++i) {
        if (lane == 0) bar_expect(&bars[i], (mode == 4 ? 1 : 2) * kBlockBytes);
        __syncwarp();
        if (lane < 16) {
          bulk(sm + i * stage + lane * pitch_k, p.k + (int64_t)ids[i] * kBlockBytes + lane * kSlot,
               kSlot, &bars[i]);
          if (mode == 0)
            bulk(sm + i * stage + kSlots * pitch_k + lane * pitch_v,
                 p.v + (int64_t)ids[i] * kBlockBytes + lane * kSlot, kSlot, &bars[i]);
        }
      }
    }
    if (mode == 4 && w > 0) {  // V: 7 warps, 16 B each
      for (int i = 0; i < n; ++i)
        for (int x = t - 32; x < kBlockBytes / 16; x += 224) {
          const int slot = x / (kSlot / 16), off = (x % (kSlot / 16)) * 16;
          ldgsts(sm + i * stage + kSlots * pitch_k + slot * pitch_v + off,
                 p.v + (int64_t)ids[i] * kBlockBytes + x * 16);
        }
      asm volatile("cp.async.wait_all;" ::: "memory");
    }
    for (int i = 0; i < n; ++i) bar_wait(&bars[i], 0);
    __syncthreads();
    acc = *reinterpret_cast<const float*>(sm + t * 4);
  } else if (mode == 1 || mode == 5 || mode == 6 || mode == 8) {
    if (mode == 5 && t < 2 * n) {
      const int i = t >> 1;
      prefetch_l2((t & 1 ? p.v : p.k) + (int64_t)ids[i] * kBlockBytes, kBlockBytes);
    }
    uint64_t pol = 0;
    if (mode == 6) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    if (t == 0) {
      for (int i = 0; i < n; ++i) {
        bar_expect(&bars[i], 2 * kBlockBytes);
        char* dk = sm + i * 2 * kBlockBytes;
        const char* sk = p.k + (int64_t)ids[i] * kBlockBytes;
        const char* sv = p.v + (int64_t)ids[i] * kBlockBytes;
        if (mode == 6) { bulk_hint(dk, sk, kBlockBytes, &bars[i], pol);
          bulk_hint(dk + kBlockBytes, sv, kBlockBytes, &bars[i], pol); }
        else if (mode == 8) { for (int j = 0; j < 4; ++j) {
          bulk(dk + j * 8192, sk + j * 8192, 8192, &bars[i]);
          bulk(dk + kBlockBytes + j * 8192, sv + j * 8192, 8192, &bars[i]); } }
        else { bulk(dk, sk, kBlockBytes, &bars[i]); bulk(dk + kBlockBytes, sv, kBlockBytes,
            &bars[i]); }
      }
    }
    for (int i = 0; i < n; ++i) bar_wait(&bars[i], 0);
    __syncthreads();
    acc = *reinterpret_cast<const float*>(sm + t * 4);
  } else if (mode == 2) {
    for (int i = 0; i < n; ++i)
      for (int x = t; x < 2 * kBlockBytes / 16; x += 256) {
        const bool isv = x >= kBlockBytes / 16; const int y = isv ? x - kBlockBytes / 16 : x;
        ldgsts(sm + i * 2 * kBlockBytes + x * 16,
            (isv ? p.v : p.k) + (int64_t)ids[i] * kBlockBytes + y * 16);
      }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    acc = *reinterpret_cast<const float*>(sm + t * 4);
  } else if (mode == 3) {
    // each thread: n blocks x 2 x 32 KB / 256 threads = 256 B per block-half = 16 uint4
    for (int i = 0; i < n; ++i) {
      uint4 r[16];
      const uint4* k4 = reinterpret_cast<const uint4*>(p.k + (int64_t)ids[i] * kBlockBytes);
      const uint4* v4 = reinterpret_cast<const uint4*>(p.v + (int64_t)ids[i] * kBlockBytes);
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = __ldg(k4 + t + 256 * j);
#pragma unroll
      for (int j = 0; j < 8; ++j) r[8 + j] = __ldg(v4 + t + 256 * j);
#pragma unroll
      for (int j = 0; j < 16; ++j) acc += __uint_as_float(r[j].x ^ r[j].w);
    }
  }
  if (acc == 1.2345f) p.out[s * 256 + t] = acc;
}

// Reference: a fully occupied grid reading the same 16.8 MB (same blocks) with ld.global.v4.
__global__ void read_all(const P p) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int b = blockIdx.x;  // 512 CTAs: one K or V block each
  const char* src = (b & 1 ? p.v : p.k) + (int64_t)p.table[b >> 1] * kBlockBytes;
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  float acc = 0.f;
  uint4 r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = __ldg(s4 + threadIdx.x + 256 * j);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc += __uint_as_float(r[j].x ^ r[j].w);
  if (acc == 1.2345f) p.out[b] = acc;
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int copies = 8;  // 8 x 16.8 MB = 134 MB > 50 MB L2
  std::vector<char*> k(copies), v(copies);
  for (int c = 0; c < copies; ++c) {
    CK(cudaMalloc(&k[c], (size_t)kBlocks * kBlockBytes * 2)); CK(cudaMalloc(&v[c],
        (size_t)kBlocks * kBlockBytes * 2));
    CK(cudaMemset(k[c], 1, (size_t)kBlocks * kBlockBytes * 2)); CK(cudaMemset(v[c], 1,
        (size_t)kBlocks * kBlockBytes * 2));
  }
  std::vector<int> perm(2 * kBlocks); for (int i = 0; i < 2 * kBlocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(1)); perm.resize(kBlocks);
  int* table; CK(cudaMalloc(&table, kBlocks * 4));
  CK(cudaMemcpy(table, perm.data(), kBlocks * 4, cudaMemcpyHostToDevice));
  float* out; CK(cudaMalloc(&out, 1 << 22));
  const int smem = 3 * kSlots * (2 * kSlot + 80);
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  const char* names[] = {"TMA per slot (2 KB), warp 0", "TMA per block (32 KB)", "LDGSTS 16 B",
                         "ld.global.v4 to regs", "K TMA slots + V LDGSTS",
                             "L2 prefetch + TMA block",
                         "TMA block, evict_first", "TMA per slot, all warps", "TMA 8 KB pieces"};
  printf("%-34s %6s %8s %8s\n", "method", "splits", "us/call", "TB/s");
  const int calls = 40;
  auto run = [&](int mode, int splits, bool ref) {
    cudaLaunchAttribute attr; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < calls; ++i) {
      P p{k[i % copies], v[i % copies], table, out, splits, mode};
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(ref ? 2 * kBlocks : splits); cfg.blockDim = dim3(256);
      cfg.dynamicSmemBytes = (ref || mode == 3) ? 0 : smem / 3 * std::min(3,
          (kBlocks + splits - 1) / splits); cfg.stream = st; cfg.attrs = &attr; cfg.numAttrs = 1;
      void* args[] = {&p};
      CK(cudaLaunchKernelExC(&cfg, ref ? (const void*)read_all : (const void*)stream, args));
    }
    CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int r = 0; r < 12; ++r) {
      CK(cudaEventRecord(a, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(b, st));
      CK(cudaEventSynchronize(b)); float ms; CK(cudaEventElapsedTime(&ms, a, b)); ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    const float us = ts[ts.size() / 2] * 1000.f / calls;
    printf("%-34s %6d %8.2f %8.2f\n", ref ? "reference: 512 CTAs ld.global" : names[mode],
           ref ? 512 : splits, us, 2.0 * kBlocks * kBlockBytes / us / 1e6);
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
  };
  run(0, 0, true);
  for (int mode : {0, 7, 1, 8, 5, 6, 2, 3, 4}) run(mode, 128, false);
  for (int mode : {0, 1}) run(mode, sms, false);
  for (int mode : {1, 3}) run(mode, 256, false);
  CK(cudaDeviceSynchronize());
  return 0;
}
