// Fused CPU Adam/AdamW kernel and its Python binding (zenflow).  See cpu_adam.h for the contract.
//
// Per element, in the order torch.optim.{AdamW,Adam} (_single_tensor_adam, CPU) applies it:
//   AdamW:  p = p * (1 - lr*wd)                     param.mul_(1 - lr*wd)
//   Adam:   g = fma(p, wd, g)                       grad.add(param, alpha=wd)
//           m = fma(w, g - m, m)   (w = 1-beta1)    exp_avg.lerp_(grad, 1-beta1)  [w >= .5: fma(w-1, g-m, g)]
//           v = fma((1-beta2)*g, g, v*beta2)        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1-beta2)
//           d = sqrt(v) / sqrt(bc2) + eps           (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
//           p = p + (-step_size * m) / d            param.addcdiv_(exp_avg, denom, value=-step_size)
//   out = bf16/fp16(p)  (round to nearest even)
// No memory besides the caller's buffers is touched; work is split into static, cache-line aligned
// chunks across OpenMP threads, vectorised with AVX-512 or AVX2+FMA, scalar for the tail.

#include "cpu_adam.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define ZF_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ZF_SIMD_AVX2 1
#endif

namespace zenflow {
namespace {

std::atomic<int> g_default_threads{0};

// ------------------------------------------------------------------------------------------------
// Scalar element update (tail and non-SIMD builds).  std::fma is exact fused multiply-add.

template <GradKind GK>
inline float load_grad_scalar(const void* g, int64_t i) {
  if constexpr (GK == GradKind::F32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (GK == GradKind::BF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  }
}

template <OutKind OK>
inline void store_out_scalar(void* out, int64_t i, float x) {
  if constexpr (OK == OutKind::BF16) {
    static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
  } else if constexpr (OK == OutKind::F16) {
    static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
  }
}

template <GradKind GK, OutKind OK>
inline void step_scalar(float* p, const void* g, float* m, float* v, void* out, int64_t i,
                        const AdamScalars& s) {
  float pv = p[i];
  float gv = load_grad_scalar<GK>(g, i);
  if (s.apply_decay) pv = pv * s.decay;
  if (s.apply_l2) gv = std::fma(pv, s.l2, gv);
  float mv = m[i];
  const float diff = gv - mv;
  mv = std::fma(s.lerp_coeff, diff, s.lerp_small ? mv : gv);
  float vv = v[i];
  vv = std::fma(s.one_minus_beta2 * gv, gv, vv * s.beta2);
  const float denom = std::sqrt(vv) / s.bc2_sqrt + s.eps;
  pv = pv + (s.neg_step_size * mv) / denom;
  p[i] = pv;
  m[i] = mv;
  v[i] = vv;
  store_out_scalar<OK>(out, i, pv);
}

// ------------------------------------------------------------------------------------------------
// Vector helpers.

#if defined(ZF_SIMD_AVX512)
constexpr int64_t kWidth = 16;
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vsqrt(vf a) { return _mm512_sqrt_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }

template <GradKind GK>
inline vf vload_grad(const void* g, int64_t i) {
  if constexpr (GK == GradKind::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (GK == GradKind::BF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

constexpr uintptr_t kOutVecBytes = 32;  // 16 halves

template <OutKind OK, bool NT>
inline void vstore_out(void* out, int64_t i, vf x) {
  if constexpr (OK == OutKind::None) {
    return;
  } else {
    __m256i h;
    if constexpr (OK == OutKind::BF16) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
      r = _mm512_srli_epi32(r, 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
      h = _mm512_cvtepi32_epi16(r);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (NT) {
      _mm256_stream_si256(dst, h);  // dst is 32-byte aligned (see run_range)
    } else {
      _mm256_storeu_si256(dst, h);
    }
  }
}
#elif defined(ZF_SIMD_AVX2)
constexpr int64_t kWidth = 8;
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vsqrt(vf a) { return _mm256_sqrt_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }

template <GradKind GK>
inline vf vload_grad(const void* g, int64_t i) {
  if constexpr (GK == GradKind::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(g) + i;
    if constexpr (GK == GradKind::BF16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
#if defined(__F16C__)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#else
      alignas(32) float tmp[8];
      for (int k = 0; k < 8; ++k) tmp[k] = f16_to_f32_soft(src[k]);
      return _mm256_load_ps(tmp);
#endif
    }
  }
}

constexpr uintptr_t kOutVecBytes = 16;  // 8 halves

template <OutKind OK, bool NT>
inline void store_half8(uint16_t* dst, __m128i h) {
  if constexpr (NT) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), h);  // dst is 16-byte aligned (see run_range)
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  }
}

template <OutKind OK, bool NT>
inline void vstore_out(void* out, int64_t i, vf x) {
  if constexpr (OK == OutKind::None) {
    return;
  } else {
    uint16_t* dst = static_cast<uint16_t*>(out) + i;
    if constexpr (OK == OutKind::BF16) {
      const __m256i u = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
      r = _mm256_srli_epi32(r, 16);
      const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      r = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
      // pack within 128-bit lanes, then gather the two useful 64-bit halves into the low lane
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      store_half8<OK, NT>(dst, _mm256_castsi256_si128(packed));
    } else {
#if defined(__F16C__)
      store_half8<OK, NT>(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
      alignas(32) float tmp[8];
      alignas(16) uint16_t hs[8];
      _mm256_store_ps(tmp, x);
      for (int k = 0; k < 8; ++k) hs[k] = f32_to_f16_soft(tmp[k]);
      store_half8<OK, NT>(dst, _mm_load_si128(reinterpret_cast<const __m128i*>(hs)));
#endif
    }
  }
}
#else
constexpr int64_t kWidth = 1;
constexpr uintptr_t kOutVecBytes = 1;
#endif

// ------------------------------------------------------------------------------------------------
// One contiguous range [begin, end).

// NT: write param_out with non-temporal (streaming) stores.  It is write-only, so this saves the
// read-for-ownership of its lines (~2 B/param of traffic); used for large outputs only, where the
// data would leave the cache before anyone reads it anyway.
template <GradKind GK, OutKind OK, bool NT>
void run_range(float* p, const void* g, float* m, float* v, void* out, int64_t begin, int64_t end,
               const AdamScalars& s) {
  int64_t i = begin;
#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
  if constexpr (NT) {  // peel until the param_out vector stores are aligned
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(out) + i) % kOutVecBytes) != 0) {
      step_scalar<GK, OK>(p, g, m, v, out, i, s);
      ++i;
    }
  }
  const vf decay = vset(s.decay);
  const vf l2 = vset(s.l2);
  const vf coeff = vset(s.lerp_coeff);
  const vf beta2 = vset(s.beta2);
  const vf omb2 = vset(s.one_minus_beta2);
  const vf bc2_sqrt = vset(s.bc2_sqrt);
  const vf eps = vset(s.eps);
  const vf nss = vset(s.neg_step_size);
  const bool do_decay = s.apply_decay, do_l2 = s.apply_l2, small = s.lerp_small;
  for (; i + kWidth <= end; i += kWidth) {
    vf pv = vload(p + i);
    vf gv = vload_grad<GK>(g, i);
    if (do_decay) pv = vmul(pv, decay);
    if (do_l2) gv = vfma(pv, l2, gv);
    vf mv = vload(m + i);
    mv = vfma(coeff, vsub(gv, mv), small ? mv : gv);
    vf vv = vload(v + i);
    vv = vfma(vmul(omb2, gv), gv, vmul(vv, beta2));
    const vf denom = vadd(vdiv(vsqrt(vv), bc2_sqrt), eps);
    pv = vadd(pv, vdiv(vmul(nss, mv), denom));
    vstore(p + i, pv);
    vstore(m + i, mv);
    vstore(v + i, vv);
    vstore_out<OK, NT>(out, i, pv);
  }
#endif
  for (; i < end; ++i) step_scalar<GK, OK>(p, g, m, v, out, i, s);
#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
  if constexpr (NT) _mm_sfence();  // order the streaming stores before the caller proceeds
#endif
}

using RangeFn = void (*)(float*, const void*, float*, float*, void*, int64_t, int64_t, const AdamScalars&);

// ------------------------------------------------------------------------------------------------
// Lean moments: exp_avg and exp_avg_sq stored as bf16 (8 B/param of host state with the fp32 master,
// 20 B/param moved per step at an fp32 gradient, 18 at bf16). Each element is computed exactly as the
// fp32 path does (same operations in fp32 registers, from the moments widened to fp32), then the new
// moments are rounded to bf16 stochastically: r = (bits(x) + u16) >> 16 with u16 uniform in [0, 2^16),
// so E[r] = x whatever the magnitude. Round-to-nearest-even would freeze exp_avg_sq: beta2 = 0.999
// changes it by 0.1% per step, below half a bf16 ulp (0.2-0.4%), so a shrinking gradient's v never
// decays and small increments are lost. The bits come from a counter-based hash of (seed, element
// index), so a step's result depends neither on the thread count nor on how the caller chunks the
// buffer (given the element's index in the whole buffer). Non-negative values round to non-negative
// values (exp_avg_sq stays >= 0), infinities stay infinite, NaN becomes bf16 NaN (0x7fc0).

// lowbias32 (Chris Wellons' integer hash): a bijection on 32 bits with good avalanche.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-call key from a 64-bit seed (the caller's: e.g. the step count and a stream id).
inline uint32_t lean_key(uint64_t seed) {
  return mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32) + 0x9e3779b9u));
}

// 32 random bits for the element at index idx (its low 32 bits): the low half rounds exp_avg, the
// high half exp_avg_sq.
inline uint32_t lean_bits(uint32_t key, uint64_t idx) { return mix32(static_cast<uint32_t>(idx) ^ key); }

inline uint16_t bf16_round_stochastic(float x, uint32_t r16) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return uint16_t((u + r16) >> 16);
}

template <GradKind GK, OutKind OK>
inline void step_scalar_lean(float* p, const void* g, uint16_t* m, uint16_t* v, void* out, int64_t i,
                             const AdamScalars& s, uint32_t key, uint64_t base) {
  float pv = p[i];
  float gv = load_grad_scalar<GK>(g, i);
  if (s.apply_decay) pv = pv * s.decay;
  if (s.apply_l2) gv = std::fma(pv, s.l2, gv);
  float mv = bf16_to_f32(m[i]);
  const float diff = gv - mv;
  mv = std::fma(s.lerp_coeff, diff, s.lerp_small ? mv : gv);
  float vv = bf16_to_f32(v[i]);
  vv = std::fma(s.one_minus_beta2 * gv, gv, vv * s.beta2);
  const float denom = std::sqrt(vv) / s.bc2_sqrt + s.eps;
  pv = pv + (s.neg_step_size * mv) / denom;
  p[i] = pv;
  const uint32_t r = lean_bits(key, base + static_cast<uint64_t>(i));
  m[i] = bf16_round_stochastic(mv, r & 0xffffu);
  v[i] = bf16_round_stochastic(vv, r >> 16);
  store_out_scalar<OK>(out, i, pv);
}

#if defined(ZF_SIMD_AVX512)
using vi = __m512i;
inline vf vload_bf16(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vi vi_set(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline vi vi_iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi vi_mul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
template <int K>
inline vi vi_srl(vi a) { return _mm512_srli_epi32(a, K); }
// bf16 bits of x (in the low 16 bits of each lane) rounded with random bits r16 (< 2^16)
inline vi vbf16_sr(vf x, vi r16) {
  const vi r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r16), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}
inline void vstore_u16(uint16_t* dst, vi r) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}
#elif defined(ZF_SIMD_AVX2)
using vi = __m256i;
inline vf vload_bf16(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vi vi_set(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline vi vi_iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi vi_mul(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
template <int K>
inline vi vi_srl(vi a) { return _mm256_srli_epi32(a, K); }
inline vi vbf16_sr(vf x, vi r16) {
  const vi r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r16), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
}
inline void vstore_u16(uint16_t* dst, vi r) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}
#endif

#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
inline vi vmix32(vi x) {
  x = vi_xor(x, vi_srl<16>(x));
  x = vi_mul(x, vi_set(0x7feb352du));
  x = vi_xor(x, vi_srl<15>(x));
  x = vi_mul(x, vi_set(0x846ca68bu));
  return vi_xor(x, vi_srl<16>(x));
}
#endif

// The lean step over [begin, end); base: the index of element 0 in the caller's whole buffer (the
// random bits' counter). NT as in run_range.
template <GradKind GK, OutKind OK, bool NT>
void run_range_lean(float* p, const void* g, uint16_t* m, uint16_t* v, void* out, int64_t begin, int64_t end,
                    const AdamScalars& s, uint32_t key, uint64_t base) {
  int64_t i = begin;
#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
  if constexpr (NT) {
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(out) + i) % kOutVecBytes) != 0) {
      step_scalar_lean<GK, OK>(p, g, m, v, out, i, s, key, base);
      ++i;
    }
  }
  const vf decay = vset(s.decay);
  const vf l2 = vset(s.l2);
  const vf coeff = vset(s.lerp_coeff);
  const vf beta2 = vset(s.beta2);
  const vf omb2 = vset(s.one_minus_beta2);
  const vf bc2_sqrt = vset(s.bc2_sqrt);
  const vf eps = vset(s.eps);
  const vf nss = vset(s.neg_step_size);
  const vi vkey = vi_set(key);
  const vi iota = vi_iota();
  const vi low16 = vi_set(0xffffu);
  const bool do_decay = s.apply_decay, do_l2 = s.apply_l2, small = s.lerp_small;
  for (; i + kWidth <= end; i += kWidth) {
    vf pv = vload(p + i);
    vf gv = vload_grad<GK>(g, i);
    if (do_decay) pv = vmul(pv, decay);
    if (do_l2) gv = vfma(pv, l2, gv);
    vf mv = vload_bf16(m + i);
    mv = vfma(coeff, vsub(gv, mv), small ? mv : gv);
    vf vv = vload_bf16(v + i);
    vv = vfma(vmul(omb2, gv), gv, vmul(vv, beta2));
    const vf denom = vadd(vdiv(vsqrt(vv), bc2_sqrt), eps);
    pv = vadd(pv, vdiv(vmul(nss, mv), denom));
    vstore(p + i, pv);
    const vi idx = vi_add(vi_set(static_cast<uint32_t>(base + static_cast<uint64_t>(i))), iota);
    const vi r = vmix32(vi_xor(idx, vkey));
    vstore_u16(m + i, vbf16_sr(mv, vi_and(r, low16)));
    vstore_u16(v + i, vbf16_sr(vv, vi_srl<16>(r)));
    vstore_out<OK, NT>(out, i, pv);
  }
#endif
  for (; i < end; ++i) step_scalar_lean<GK, OK>(p, g, m, v, out, i, s, key, base);
#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
  if constexpr (NT) _mm_sfence();
#endif
}

using LeanFn = void (*)(float*, const void*, uint16_t*, uint16_t*, void*, int64_t, int64_t, const AdamScalars&,
                        uint32_t, uint64_t);

#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
// vec(k) for every whole vector from i up to end, four per iteration, then one at a time; returns
// where the scalar tail starts. Each element is computed alone, so the unrolling changes no bits.
template <class VecFn>
inline int64_t for_vectors(int64_t i, int64_t end, VecFn&& vec) {
  for (; i + 4 * kWidth <= end; i += 4 * kWidth) {
    vec(i);
    vec(i + kWidth);
    vec(i + 2 * kWidth);
    vec(i + 3 * kWidth);
  }
  for (; i + kWidth <= end; i += kWidth) vec(i);
  return i;
}
#endif

// Window accumulation over [begin, end): acc = x * alpha on a window's first step (without SCALE,
// alpha == 1: a plain copy / upcast, as torch's acc.copy_(src)), else acc = fma(x, alpha, acc).
// Plain stores: streaming ones for the write-only acc of a first step measured 2-7% slower than
// these (bench.cpu_adam, 1-2 threads, 50M elements).
template <GradKind GK, bool FIRST, bool SCALE>
void acc_range(float* acc, const void* src, int64_t begin, int64_t end, float alpha) {
  auto one = [&](int64_t k) {
    const float x = load_grad_scalar<GK>(src, k);
    if constexpr (!FIRST) {
      acc[k] = std::fma(x, alpha, acc[k]);
    } else if constexpr (SCALE) {
      acc[k] = x * alpha;
    } else {
      acc[k] = x;
    }
  };
  int64_t i = begin;
#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
  const vf a = vset(alpha);
  auto vec = [&](int64_t k) {
    const vf x = vload_grad<GK>(src, k);
    if constexpr (!FIRST) {
      vstore(acc + k, vfma(x, a, vload(acc + k)));
    } else if constexpr (SCALE) {
      vstore(acc + k, vmul(x, a));
    } else {
      vstore(acc + k, x);
    }
  };
  i = for_vectors(i, end, vec);
#endif
  for (; i < end; ++i) one(i);
}

using AccFn = void (*)(float*, const void*, int64_t, int64_t, float);

// The same with the accumulator in src's low-precision dtype: the sum is formed in fp32 exactly as
// above and rounded to nearest even once per call (alpha == 1 multiplies too: torch's path rounds
// the fp32 product, which turns every NaN into the canonical one, as the rounding here does).
template <GradKind GK, OutKind OK, bool FIRST>
void acc_range_low(void* acc, const void* src, int64_t begin, int64_t end, float alpha) {
  auto one = [&](int64_t k) {
    const float x = load_grad_scalar<GK>(src, k);
    if constexpr (FIRST) {
      store_out_scalar<OK>(acc, k, x * alpha);
    } else {
      store_out_scalar<OK>(acc, k, std::fma(x, alpha, load_grad_scalar<GK>(acc, k)));
    }
  };
  int64_t i = begin;
#if defined(ZF_SIMD_AVX512) || defined(ZF_SIMD_AVX2)
  const vf a = vset(alpha);
  auto vec = [&](int64_t k) {
    const vf x = vload_grad<GK>(src, k);
    if constexpr (FIRST) {
      vstore_out<OK, false>(acc, k, vmul(x, a));
    } else {
      vstore_out<OK, false>(acc, k, vfma(x, a, vload_grad<GK>(acc, k)));
    }
  };
  i = for_vectors(i, end, vec);
#endif
  for (; i < end; ++i) one(i);
}

using AccLowFn = void (*)(void*, const void*, int64_t, int64_t, float);

AccLowFn pick_acc_low(GradKind gk, bool first) {
  if (gk == GradKind::BF16) {
    return first ? &acc_range_low<GradKind::BF16, OutKind::BF16, true> : &acc_range_low<GradKind::BF16, OutKind::BF16, false>;
  }
  return first ? &acc_range_low<GradKind::F16, OutKind::F16, true> : &acc_range_low<GradKind::F16, OutKind::F16, false>;
}

template <GradKind GK>
AccFn pick_acc_kind(bool first, bool scale) {
  if (!first) return &acc_range<GK, false, true>;
  return scale ? &acc_range<GK, true, true> : &acc_range<GK, true, false>;
}

AccFn pick_acc(GradKind gk, bool first, bool scale) {
  switch (gk) {
    case GradKind::BF16: return pick_acc_kind<GradKind::BF16>(first, scale);
    case GradKind::F16: return pick_acc_kind<GradKind::F16>(first, scale);
    default: return pick_acc_kind<GradKind::F32>(first, scale);
  }
}

template <GradKind GK>
RangeFn pick_out(OutKind ok, bool nt) {
  switch (ok) {
    case OutKind::BF16: return nt ? &run_range<GK, OutKind::BF16, true> : &run_range<GK, OutKind::BF16, false>;
    case OutKind::F16: return nt ? &run_range<GK, OutKind::F16, true> : &run_range<GK, OutKind::F16, false>;
    default: return &run_range<GK, OutKind::None, false>;
  }
}

RangeFn pick(GradKind gk, OutKind ok, bool nt) {
  switch (gk) {
    case GradKind::BF16: return pick_out<GradKind::BF16>(ok, nt);
    case GradKind::F16: return pick_out<GradKind::F16>(ok, nt);
    default: return pick_out<GradKind::F32>(ok, nt);
  }
}

template <GradKind GK>
LeanFn pick_lean_out(OutKind ok, bool nt) {
  switch (ok) {
    case OutKind::BF16:
      return nt ? &run_range_lean<GK, OutKind::BF16, true> : &run_range_lean<GK, OutKind::BF16, false>;
    case OutKind::F16:
      return nt ? &run_range_lean<GK, OutKind::F16, true> : &run_range_lean<GK, OutKind::F16, false>;
    default: return &run_range_lean<GK, OutKind::None, false>;
  }
}

LeanFn pick_lean(GradKind gk, OutKind ok, bool nt) {
  switch (gk) {
    case GradKind::BF16: return pick_lean_out<GradKind::BF16>(ok, nt);
    case GradKind::F16: return pick_lean_out<GradKind::F16>(ok, nt);
    default: return pick_lean_out<GradKind::F32>(ok, nt);
  }
}

constexpr int64_t kLineFloats = 16;         // 64-byte cache line of fp32
constexpr int64_t kChunkAlign = 32;         // chunk granularity: 128 B of fp32, 64 B of bf16/fp16
constexpr int64_t kMinPerThread = 1 << 15;  // below this a thread costs more than it brings
constexpr int64_t kStreamOutMin = 1 << 16;  // param_out of >= 128 KiB is written with streaming stores

}  // namespace

AdamScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool adamw, bool bias_correction) {
  AdamScalars s;
  const double w1 = 1.0 - beta1;
  s.lerp_small = std::abs(static_cast<float>(w1)) < 0.5f;
  s.lerp_coeff = s.lerp_small ? static_cast<float>(w1) : static_cast<float>(w1) - 1.0f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  if (weight_decay != 0.0) {
    if (adamw) {
      s.apply_decay = true;
      s.decay = static_cast<float>(1.0 - lr * weight_decay);
    } else {
      s.apply_l2 = true;
      s.l2 = static_cast<float>(weight_decay);
    }
  }
  double step_size = lr;
  if (bias_correction) {
    const double t = static_cast<double>(step);
    const double bc1 = 1.0 - std::pow(beta1, t);
    const double bc2 = 1.0 - std::pow(beta2, t);
    step_size = lr / bc1;
    s.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));  // Python's `x ** 0.5`, not sqrt()
  }
  s.neg_step_size = static_cast<float>(-step_size);
  return s;
}

namespace {

// Run f(begin, end) over [0, n) in static chunks, one per thread.  Chunk boundaries are multiples of
// kChunkAlign elements counted from a 64-byte line of `anchor` (the param buffer), so fp32 buffers
// sharing the anchor's alignment (torch allocations do) split on cache lines, and 2-byte buffers
// (bf16/fp16 grads, param_out) too.
template <typename F>
void for_chunks(int64_t n, const void* anchor, int num_threads, F&& f) {
  int nt = num_threads > 0 ? num_threads : default_threads();
  nt = static_cast<int>(std::min<int64_t>(nt, std::max<int64_t>(1, n / kMinPerThread)));
  if (nt <= 1) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t shift = static_cast<int64_t>((reinterpret_cast<uintptr_t>(anchor) / sizeof(float)) % kLineFloats);
  const int64_t base = (n + nt - 1) / nt;
  auto boundary = [&](int64_t k) -> int64_t {
    if (k <= 0) return 0;
    if (k >= nt) return n;
    const int64_t x = ((k * base + shift + kChunkAlign - 1) / kChunkAlign) * kChunkAlign - shift;
    return std::clamp<int64_t>(x, 0, n);
  };
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    const int team = omp_get_num_threads();
    // If the runtime grants fewer threads than asked, the last member takes the remainder.
    const int64_t b = boundary(tid);
    const int64_t e = (tid == team - 1) ? n : boundary(tid + 1);
    if (b < e) f(b, e);
  }
}

}  // namespace

void adam_update(float* p, const void* g, GradKind gk, float* m, float* v, void* out, OutKind ok,
                 int64_t n, const AdamScalars& s, int num_threads) {
  if (n <= 0) return;
  // out == g (the new parameter written over the gradient it came from): plain stores, the lines are
  // in the cache already
  const bool stream = ok != OutKind::None && n >= kStreamOutMin && out != g;
  const RangeFn fn = pick(gk, ok, stream);
  for_chunks(n, p, num_threads, [&](int64_t b, int64_t e) { fn(p, g, m, v, out, b, e, s); });
}

void adam_update_lean(float* p, const void* g, GradKind gk, uint16_t* m, uint16_t* v, void* out, OutKind ok,
                      int64_t n, const AdamScalars& s, uint64_t seed, uint64_t index_base, int num_threads) {
  if (n <= 0) return;
  const bool stream = ok != OutKind::None && n >= kStreamOutMin && out != g;
  const LeanFn fn = pick_lean(gk, ok, stream);
  const uint32_t key = lean_key(seed);
  for_chunks(n, p, num_threads, [&](int64_t b, int64_t e) { fn(p, g, m, v, out, b, e, s, key, index_base); });
}

void accumulate(float* acc, const void* src, GradKind gk, int64_t n, float alpha, bool first, int num_threads) {
  if (n <= 0) return;
  const AccFn fn = pick_acc(gk, first, alpha != 1.0f);
  for_chunks(n, acc, num_threads, [&](int64_t b, int64_t e) { fn(acc, src, b, e, alpha); });
}

void accumulate_low(void* acc, const void* src, GradKind gk, int64_t n, float alpha, bool first, int num_threads) {
  if (n <= 0) return;
  const AccLowFn fn = pick_acc_low(gk, first);
  for_chunks(n, acc, num_threads, [&](int64_t b, int64_t e) { fn(acc, src, b, e, alpha); });
}

double stream_probe(float* p, const float* g, float* m, float* v, int64_t n, int num_threads) {
  // Same streams as the fp32 Adam step (read p, g, m, v; write p, m, v), trivial arithmetic.
  const auto t0 = std::chrono::steady_clock::now();
  for_chunks(n, p, num_threads, [&](int64_t b, int64_t e) {
#pragma omp simd
    for (int64_t i = b; i < e; ++i) {
      const float gi = g[i];
      p[i] += gi;
      m[i] += gi;
      v[i] += gi;
    }
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const char* simd_name() {
#if defined(ZF_SIMD_AVX512)
  return "avx512";
#elif defined(ZF_SIMD_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

void set_default_threads(int n) { g_default_threads.store(n < 0 ? 0 : n); }

int default_threads() {
  const int n = g_default_threads.load();
  return n > 0 ? n : std::max(1, at::get_num_threads());
}

}  // namespace zenflow

// ==================================================================================================
// Python binding.

namespace {

namespace py = pybind11;
using zenflow::GradKind;
using zenflow::OutKind;

void check_dense_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), name, " is undefined");
  TORCH_CHECK(t.layout() == c10::kStrided, name, " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (sizes ", t.sizes(), ", strides ", t.strides(), ")");
  TORCH_CHECK(!t.is_complex(), name, " must be real, got ", t.scalar_type());
}

void check_disjoint(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn) {
  const auto st = at::get_overlap_status(a, b);
  TORCH_CHECK(st == at::MemOverlapStatus::No, an, " and ", bn, " must not share memory");
}

void bump(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, int64_t step,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
               bool bias_correction, int64_t num_threads, int64_t rng_seed, int64_t rng_offset) {
  check_dense_cpu(param, "param");
  check_dense_cpu(grad, "grad");
  check_dense_cpu(exp_avg, "exp_avg");
  check_dense_cpu(exp_avg_sq, "exp_avg_sq");
  TORCH_CHECK(param.scalar_type() == at::kFloat, "param must be float32 (fp32 master weights), got ",
              param.scalar_type());
  // fp32 moments, or bf16 moments (lean: rounded stochastically, see adam_update_lean)
  const bool lean = exp_avg.scalar_type() == at::kBFloat16;
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat || lean, "exp_avg must be float32 or bfloat16, got ",
              exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == exp_avg.scalar_type(), "exp_avg_sq must have exp_avg's dtype (",
              exp_avg.scalar_type(), "), got ", exp_avg_sq.scalar_type());
  TORCH_CHECK(rng_offset >= 0, "rng_offset must be >= 0, got ", rng_offset);
  GradKind gk;
  switch (grad.scalar_type()) {
    case at::kFloat: gk = GradKind::F32; break;
    case at::kBFloat16: gk = GradKind::BF16; break;
    case at::kHalf: gk = GradKind::F16; break;
    default: TORCH_CHECK(false, "grad must be float32, bfloat16 or float16, got ", grad.scalar_type());
  }
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n, "grad has ", grad.numel(), " elements, param has ", n);
  TORCH_CHECK(exp_avg.numel() == n, "exp_avg has ", exp_avg.numel(), " elements, param has ", n);
  TORCH_CHECK(exp_avg_sq.numel() == n, "exp_avg_sq has ", exp_avg_sq.numel(), " elements, param has ", n);
  check_disjoint(param, "param", exp_avg, "exp_avg");
  check_disjoint(param, "param", exp_avg_sq, "exp_avg_sq");
  check_disjoint(exp_avg, "exp_avg", exp_avg_sq, "exp_avg_sq");
  check_disjoint(param, "param", grad, "grad");
  OutKind ok = OutKind::None;
  void* out_ptr = nullptr;
  if (param_out.has_value() && param_out->defined()) {
    const at::Tensor& po = *param_out;
    check_dense_cpu(po, "param_out");
    switch (po.scalar_type()) {
      case at::kBFloat16: ok = OutKind::BF16; break;
      case at::kHalf: ok = OutKind::F16; break;
      default: TORCH_CHECK(false, "param_out must be bfloat16 or float16, got ", po.scalar_type());
    }
    TORCH_CHECK(po.numel() == n, "param_out has ", po.numel(), " elements, param has ", n);
    check_disjoint(po, "param_out", param, "param");
    // param_out may be the gradient buffer itself (each element is read before it is overwritten)
    const bool same = po.data_ptr() == grad.data_ptr() && po.scalar_type() == grad.scalar_type();
    if (!same) check_disjoint(po, "param_out", grad, "grad");
    check_disjoint(po, "param_out", exp_avg, "exp_avg");
    check_disjoint(po, "param_out", exp_avg_sq, "exp_avg_sq");
    out_ptr = po.data_ptr();
  }
  TORCH_CHECK(!bias_correction || step >= 1, "step must be >= 1 with bias correction, got ", step);
  TORCH_CHECK(num_threads >= 0, "num_threads must be >= 0 (0 = default), got ", num_threads);
  TORCH_CHECK(std::isfinite(lr) && std::isfinite(eps) && std::isfinite(weight_decay),
              "lr, eps and weight_decay must be finite");

  const zenflow::AdamScalars s =
      zenflow::make_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction);
  float* p = param.data_ptr<float>();
  const void* g = grad.data_ptr();
  if (lean) {
    auto* m16 = static_cast<uint16_t*>(exp_avg.data_ptr());
    auto* v16 = static_cast<uint16_t*>(exp_avg_sq.data_ptr());
    py::gil_scoped_release no_gil;
    zenflow::adam_update_lean(p, g, gk, m16, v16, out_ptr, ok, n, s, static_cast<uint64_t>(rng_seed),
                              static_cast<uint64_t>(rng_offset), static_cast<int>(num_threads));
  } else {
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    py::gil_scoped_release no_gil;
    zenflow::adam_update(p, g, gk, m, v, out_ptr, ok, n, s, static_cast<int>(num_threads));
  }
  bump(param);
  bump(exp_avg);
  bump(exp_avg_sq);
  if (out_ptr != nullptr) bump(*param_out);
}

GradKind grad_kind(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return GradKind::F32;
    case at::kBFloat16: return GradKind::BF16;
    case at::kHalf: return GradKind::F16;
    default: break;
  }
  TORCH_CHECK(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  return GradKind::F32;  // unreachable
}

void accumulate(const at::Tensor& acc, const at::Tensor& src, double alpha, bool first, int64_t num_threads) {
  check_dense_cpu(acc, "acc");
  check_dense_cpu(src, "src");
  const GradKind gk = grad_kind(src, "src");
  const bool low = acc.scalar_type() != at::kFloat;
  TORCH_CHECK(!low || (gk != GradKind::F32 && acc.scalar_type() == src.scalar_type()),
              "acc must be float32 or src's dtype (bfloat16/float16), got ", acc.scalar_type(), " for src ",
              src.scalar_type());
  TORCH_CHECK(src.numel() == acc.numel(), "src has ", src.numel(), " elements, acc has ", acc.numel());
  check_disjoint(acc, "acc", src, "src");
  TORCH_CHECK(std::isfinite(alpha), "alpha must be finite");
  TORCH_CHECK(num_threads >= 0, "num_threads must be >= 0 (0 = default), got ", num_threads);
  const void* s = src.data_ptr();
  {
    py::gil_scoped_release no_gil;
    if (low) {
      zenflow::accumulate_low(acc.data_ptr(), s, gk, acc.numel(), static_cast<float>(alpha), first,
                              static_cast<int>(num_threads));
    } else {
      zenflow::accumulate(acc.data_ptr<float>(), s, gk, acc.numel(), static_cast<float>(alpha), first,
                          static_cast<int>(num_threads));
    }
  }
  bump(acc);
}

// Benchmark hook: time the fp32 step's memory streams with trivial arithmetic (seconds).
double stream_probe_py(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                       int64_t num_threads) {
  const at::Tensor* ts[] = {&p, &g, &m, &v};
  const char* names[] = {"p", "g", "m", "v"};
  for (int k = 0; k < 4; ++k) {
    check_dense_cpu(*ts[k], names[k]);
    TORCH_CHECK(ts[k]->scalar_type() == at::kFloat, names[k], " must be float32");
    TORCH_CHECK(ts[k]->numel() == p.numel(), names[k], " must have p's numel");
  }
  py::gil_scoped_release no_gil;
  return zenflow::stream_probe(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                               p.numel(), static_cast<int>(num_threads));
}

// Test hook: convert a float32 tensor to bf16/fp16 (or back) with the scalar or the vector path.
at::Tensor convert(const at::Tensor& src, const at::Tensor& dst, bool soft) {
  check_dense_cpu(src, "src");
  check_dense_cpu(dst, "dst");
  TORCH_CHECK(src.numel() == dst.numel(), "src and dst must have equal numel");
  const int64_t n = src.numel();
  if (src.scalar_type() == at::kFloat && dst.scalar_type() == at::kHalf) {
    const float* s = src.data_ptr<float>();
    auto* d = static_cast<uint16_t*>(dst.data_ptr());
    for (int64_t i = 0; i < n; ++i) d[i] = soft ? zenflow::f32_to_f16_soft(s[i]) : zenflow::f32_to_f16(s[i]);
  } else if (src.scalar_type() == at::kHalf && dst.scalar_type() == at::kFloat) {
    const auto* s = static_cast<const uint16_t*>(src.data_ptr());
    float* d = dst.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = soft ? zenflow::f16_to_f32_soft(s[i]) : zenflow::f16_to_f32(s[i]);
  } else if (src.scalar_type() == at::kFloat && dst.scalar_type() == at::kBFloat16) {
    const float* s = src.data_ptr<float>();
    auto* d = static_cast<uint16_t*>(dst.data_ptr());
    for (int64_t i = 0; i < n; ++i) d[i] = zenflow::f32_to_bf16(s[i]);
  } else {
    TORCH_CHECK(false, "unsupported conversion ", src.scalar_type(), " -> ", dst.scalar_type());
  }
  return dst;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zenflow fused CPU Adam/AdamW";
  m.def("adam_step", &adam_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("param_out"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"), py::arg("num_threads"),
        py::arg("rng_seed") = 0, py::arg("rng_offset") = 0,
        "In-place fused Adam/AdamW step (releases the GIL while computing); bf16 moments are rounded "
        "stochastically with bits from (rng_seed, rng_offset + element index).");
  m.def("accumulate", &accumulate, py::arg("acc"), py::arg("src"), py::arg("alpha"), py::arg("first"),
        py::arg("num_threads"),
        "acc = src * alpha (first) or acc += src * alpha, src fp32/bf16/fp16, acc fp32 or src's dtype "
        "(releases the GIL).");
  m.def("set_num_threads", [](int n) {
    TORCH_CHECK(n >= 0, "num_threads must be >= 0 (0 = follow torch.get_num_threads()), got ", n);
    zenflow::set_default_threads(n);
  });
  m.def("get_num_threads", &zenflow::default_threads);
  m.def("simd_width", &zenflow::simd_name);
  m.def("has_f16c", []() {
#if defined(__F16C__)
    return true;
#else
    return false;
#endif
  });
  m.def("_stream_probe", &stream_probe_py, py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"),
        py::arg("num_threads"));
  m.def("_convert", &convert, py::arg("src"), py::arg("dst"), py::arg("soft"));
}
