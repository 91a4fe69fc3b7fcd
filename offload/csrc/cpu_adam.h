// Fused CPU Adam/AdamW for CPU-resident fp32 optimizer state (zenflow).
//
// One pass per element: optional decoupled weight decay (AdamW) or L2 term (Adam), first/second
// moment update, bias-corrected step, optional low-precision copy of the new parameter.
// The elementwise operation order mirrors torch.optim.AdamW/Adam (single-tensor path, CPU kernels,
// with an FMA exactly where ATen's kernels fuse: lerp, addcmul, add(alpha)), so results are bitwise
// identical to those torch ops for the same fp32 inputs, except for sqrt: ours is correctly rounded,
// torch's CPU Tensor.sqrt goes through MKL VML and can be 1 ulp off.  Build with -ffp-contract=off
// so that only the explicit FMAs fuse.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace zenflow {

enum class GradKind : int { F32 = 0, BF16 = 1, F16 = 2 };
enum class OutKind : int { None = 0, BF16 = 1, F16 = 2 };

// Per-call scalar factors, computed in double (as torch does with Python floats) and then cast to
// fp32, the precision in which ATen applies a Python scalar to an fp32 tensor.
struct AdamScalars {
  float decay = 1.0f;          // 1 - lr * wd          (AdamW, applied when apply_decay)
  float l2 = 0.0f;             // wd                   (Adam, grad += wd * param when apply_l2)
  float lerp_coeff = 0.0f;     // (1 - beta1), or (1 - beta1) - 1 when the lerp weight is >= 0.5
  bool lerp_small = true;      // |1 - beta1| < 0.5: m + w * (g - m); else g + (w - 1) * (g - m)
  float beta2 = 0.0f;
  float one_minus_beta2 = 0.0f;
  float bc2_sqrt = 1.0f;       // sqrt(1 - beta2^step)  (1 without bias correction)
  float eps = 0.0f;
  float neg_step_size = 0.0f;  // -lr / (1 - beta1^step)
  bool apply_decay = false;
  bool apply_l2 = false;
};

AdamScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool adamw, bool bias_correction);

// In-place update of n elements. g points to float / bf16 / fp16 data (gk); out (ok != None) receives
// the updated parameter as bf16 / fp16, and may be g itself (same dtype: the gradient is overwritten). num_threads <= 0 means the global default.
void adam_update(float* p, const void* g, GradKind gk, float* m, float* v, void* out, OutKind ok,
                 int64_t n, const AdamScalars& s, int num_threads);

// The same step with bf16 moments (m, v: bf16 bits), computed in fp32 from them and rounded back
// stochastically with bits hashed from (seed, index_base + i): the result depends neither on
// num_threads nor on how a caller splits a buffer into calls (index_base: the first element's index in
// the whole buffer). Each p is bitwise what adam_update gives for the moments widened to fp32; each new
// moment is one of the two bf16 values around that fp32 result, the upper one with probability equal
// to the fraction of the way to it.
void adam_update_lean(float* p, const void* g, GradKind gk, uint16_t* m, uint16_t* v, void* out, OutKind ok,
                      int64_t n, const AdamScalars& s, uint64_t seed, uint64_t index_base, int num_threads);

// Window accumulation (zenflow, accumulate_on="host"): acc = src * alpha when first (alpha == 1: a
// plain copy / upcast, every bit pattern kept, as ATen's acc.copy_(src)), else acc = fma(src, alpha,
// acc), i.e. ATen's `acc.add_(src, alpha=alpha)` (vectorised with a fused multiply-add) on src upcast
// to fp32; src is float / bf16 / fp16 (gk). num_threads <= 0: default.
void accumulate(float* acc, const void* src, GradKind gk, int64_t n, float alpha, bool first, int num_threads);

// The same with acc in src's low-precision dtype (gk BF16 or F16): the fp32 result of each element is
// rounded to nearest even into acc.
void accumulate_low(void* acc, const void* src, GradKind gk, int64_t n, float alpha, bool first, int num_threads);

// Bandwidth reference: the fp32 step's memory streams with trivial arithmetic; returns seconds.
double stream_probe(float* p, const float* g, float* m, float* v, int64_t n, int num_threads);

const char* simd_name();
void set_default_threads(int n);  // 0 = follow torch's intra-op thread count
int default_threads();

// ---------------------------------------------------------------------------------------------
// Scalar conversions (used for the tail and as the reference for the vector paths).

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// Round to nearest even, NaN -> 0x7FC0 (same as c10::BFloat16).
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Portable IEEE binary16 conversions (round to nearest even), used when F16C is unavailable.
inline float f16_to_f32_soft(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24 is exact in fp32
    const float mag = float(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf / NaN
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_f16_soft(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {  // normal half: rebias exponent (-112 << 23), round on bit 13
    a += 0xc8000fffu + ((a >> 13) & 1u);
    return uint16_t(sign | (a >> 13));
  }
  // Subnormal half or zero: adding 0.5f leaves an fp32 whose ulp is 2^-24, so the FPU performs the
  // round-to-nearest-even of |f| * 2^24 for us; 1024 correctly becomes the smallest normal.
  const float r = bits_f32(a) + 0.5f;
  return uint16_t(sign | (f32_bits(r) - 0x3f000000u));
}

inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return f16_to_f32_soft(h);
#endif
}

inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
  return uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  return f32_to_f16_soft(f);
#endif
}

}  // namespace zenflow
