// What ops.cpp hands each kernel: plain pointers and sizes, checked there once. Each kernel source
// is compiled once per ISA (FERRY_ISA: avx512 or avx2, flags in workers/engine/cpu/kernels.py) into
// a namespace of that name, with no torch header heavier than ATen/Parallel.h, so that the build
// parses torch's library headers once (ops.cpp) however many kernels and ISAs there are.
#pragma once

#include <cstdint>

namespace ferry {

enum class Dtype { kFloat32, kBFloat16 };

struct PagedAttention {
  const void* qkv;        // [tokens, (heads + 2 * kv_heads) * dim]
  const float* cos;       // [positions, dim], or null: no RoPE
  const float* sin;
  const int64_t* positions;  // [tokens]
  const int64_t* slots;      // [tokens]
  void* cache;               // [2, kv_heads, blocks, block_size, dim]
  const int64_t* starts;     // [seqs + 1]
  const int32_t* tables;     // [seqs, max_blocks]
  void* out;                 // [tokens, heads * dim]
  int64_t tokens, seqs, heads, kv_heads, dim, blocks, block_size, max_blocks;
  float scale;
  Dtype dtype;
};

// residual += x (x null: residual as it is), then out = weight * RMSNorm(residual); [rows, cols].
struct AddRmsNorm {
  const void* x;     // [rows, cols], or null
  void* residual;    // [rows, cols], written
  const void* weight;  // [cols]
  void* out;         // [rows, cols]
  int64_t rows, cols;
  float eps;
  Dtype dtype;
};

// out = SiLU(gate) * up, gate and up the halves of each row of gate_up.
struct SiluMul {
  const void* gate_up;  // [rows, 2 * cols]
  void* out;            // [rows, cols]
  int64_t rows, cols;
  Dtype dtype;
};

#define FERRY_KERNELS_OF(isa)                        \
  namespace isa {                                    \
  void paged_attention(const PagedAttention& args);  \
  void add_rms_norm(const AddRmsNorm& args);         \
  void silu_mul(const SiluMul& args);                \
  }

FERRY_KERNELS_OF(avx512)
FERRY_KERNELS_OF(avx2)

}  // namespace ferry
