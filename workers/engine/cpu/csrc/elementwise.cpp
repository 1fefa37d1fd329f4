// The small operators of a decoder layer, each fused into one pass over its rows (what and why:
// workers/engine/cpu/kernels.py and docs/engine.md, "On a CPU"; the arguments: kernels.h):
//
//   add_rms_norm   residual += x, then RMSNorm of the sum: one read of each, where torch runs an
//                  add, a cast, a square, a mean, an rsqrt, two multiplies and a cast back
//   silu_mul       SiLU(gate) * up from the fused gate-up projection: one pass, no chunk views
//
// Each rounds where transformers' model does in torch (bfloat16 after the add, after the norm's
// float32 scaling, after SiLU and after the product), computing in float32 between, so the
// numbers are torch's up to the order of a row's sum of squares and exp's last bit.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace ferry::FERRY_ISA {
namespace {

constexpr int64_t kGrainElements = 16384;  // elements a thread takes at least: a small step stays on one

// A float32 value as T holds it: float32 as is, bfloat16 rounded to nearest even.
template <typename T>
float held(float x) {
  if constexpr (std::is_same_v<T, bf16>) {
    const uint32_t u = static_cast<uint32_t>(bf16_bits(x)) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return x;
  }
}
template <typename T>
Vec held(Vec x) {
  if constexpr (std::is_same_v<T, bf16>) return x.bf16_rounded();
  else return x;
}

template <typename T>
Vec load_like(Vec, const T* p) { return Vec::load(p); }
template <typename T>
float load_like(float, const T* p) { return to_float(*p); }
template <typename T>
void store_from(T* p, Vec v) { v.store(p); }
template <typename T>
void store_from(T* p, float v) { store_scalar(p, v); }

// f(i, lane) over a row of n: whole vectors (lane a Vec), then the tail one element at a time
// (lane a float), so any row length works and the body is written once.
template <typename F>
void along(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) f(i, Vec::zero());
  for (; i < n; ++i) f(i, 0.0f);
}

inline Vec silu(Vec g) { return g / (Vec::all(1.0f) + exp(Vec::zero() - g)); }
inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

template <typename T>
void add_rms_norm_rows(const ferry::AddRmsNorm& a) {
  const int64_t cols = a.cols;
  const auto* x = static_cast<const T*>(a.x);
  auto* residual = static_cast<T*>(a.residual);
  const auto* weight = static_cast<const T*>(a.weight);
  auto* out = static_cast<T*>(a.out);
  at::parallel_for(0, a.rows, std::max<int64_t>(1, kGrainElements / cols), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* r = residual + row * cols;
      const T* xr = x ? x + row * cols : nullptr;
      Vec squares = Vec::zero();
      float tail = 0.0f;
      along(cols, [&](int64_t i, auto lane) {
        auto h = load_like(lane, r + i);
        if (xr) {
          h = held<T>(h + load_like(lane, xr + i));
          store_from(r + i, h);
        }
        if constexpr (std::is_same_v<decltype(lane), Vec>) squares = fma(h, h, squares);
        else tail += h * h;
      });
      const float inverse = 1.0f / std::sqrt((squares.sum() + tail) / static_cast<float>(cols) + a.eps);
      T* o = out + row * cols;
      along(cols, [&](int64_t i, auto lane) {
        auto scaled = load_like(lane, r + i);
        if constexpr (std::is_same_v<decltype(lane), Vec>) scaled = held<T>(scaled * Vec::all(inverse));
        else scaled = held<T>(scaled * inverse);
        store_from(o + i, load_like(lane, weight + i) * scaled);
      });
    }
  });
}

template <typename T>
void silu_mul_rows(const ferry::SiluMul& a) {
  const int64_t cols = a.cols;
  const auto* gate_up = static_cast<const T*>(a.gate_up);
  auto* out = static_cast<T*>(a.out);
  at::parallel_for(0, a.rows, std::max<int64_t>(1, kGrainElements / cols), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = gate_up + row * 2 * cols;
      const T* up = gate + cols;
      T* o = out + row * cols;
      along(cols, [&](int64_t i, auto lane) {
        store_from(o + i, held<T>(silu(load_like(lane, gate + i))) * load_like(lane, up + i));
      });
    }
  });
}

}  // namespace

void add_rms_norm(const ferry::AddRmsNorm& args) {
  if (args.dtype == Dtype::kBFloat16) add_rms_norm_rows<bf16>(args);
  else add_rms_norm_rows<float>(args);
}

void silu_mul(const ferry::SiluMul& args) {
  if (args.dtype == Dtype::kBFloat16) silu_mul_rows<bf16>(args);
  else silu_mul_rows<float>(args);
}

}  // namespace ferry::FERRY_ISA
