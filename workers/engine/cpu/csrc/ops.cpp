// The library's operators: each tensor checked once here (shapes, dtypes, every index against
// what it indexes), then handed as pointers to the kernel of the ISA the operator's name ends in
// (kernels.h). Registered under FERRY_OPS, a namespace named after the sources
// (workers/engine/cpu/kernels.py), so that a process can load two versions of them.

#include "kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

namespace ferry {
namespace {

constexpr int64_t kMaxGroup = 32;  // query heads per KV head: a task's rows (paged_attention.cpp)

Dtype dtype_of(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, op,
              ": bfloat16 or float32 expected");
  return t.scalar_type() == at::kBFloat16 ? Dtype::kBFloat16 : Dtype::kFloat32;
}

void check_index(const at::Tensor& t, int64_t length, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == length && t.is_contiguous(), name,
              " must be a contiguous int64 [", length, "]");
}

// qkv [tokens, (heads + 2 * kv_heads) * head_dim]: the step's Q, K and V before RoPE; cos, sin
// [positions, head_dim] float32 RoPE tables, or empty (no RoPE); positions, slots [tokens]; cache
// [2, kv_heads, blocks, block_size, head_dim] of qkv's dtype, written; starts [seqs + 1]: sequence
// s owns tokens starts[s] .. starts[s + 1] - 1; tables [seqs, max_blocks] int32 -> [tokens, heads * head_dim].
template <void (*Kernel)(const PagedAttention&)>
at::Tensor paged_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& positions, const at::Tensor& slots, at::Tensor cache,
                           const at::Tensor& starts, const at::Tensor& tables, int64_t heads, double scale) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "paged_attention: cache must be a contiguous [2, kv_heads, blocks, block_size, head_dim]");
  const int64_t kv_heads = cache.size(1), dim = cache.size(4), blocks = cache.size(2), block_size = cache.size(3);
  TORCH_CHECK(heads >= kv_heads && kv_heads >= 1 && heads % kv_heads == 0,
              "paged_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(heads / kv_heads <= kMaxGroup, "paged_attention: at most ", kMaxGroup, " query heads per KV head");
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256,
              "paged_attention: head_dim must be 16, 32, 64, 128 or 256, got ", dim);
  const int64_t width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && qkv.is_contiguous(),
              "paged_attention: qkv must be a contiguous [tokens, ", width, "]");
  TORCH_CHECK(qkv.scalar_type() == cache.scalar_type(), "paged_attention: qkv and cache must both be bfloat16 or both float32");
  const Dtype dtype = dtype_of(qkv, "paged_attention");
  const int64_t tokens = qkv.size(0);
  check_index(positions, tokens, "paged_attention: positions");
  check_index(slots, tokens, "paged_attention: slots");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.size(0) >= 2 && starts.is_contiguous(),
              "paged_attention: starts must be int64 [seqs + 1]");
  const int64_t seqs = starts.size(0) - 1;
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.size(0) == seqs && tables.is_contiguous(),
              "paged_attention: tables must be a contiguous int32 [seqs, max_blocks]");
  const bool rope = cos.numel() > 0;
  if (rope)
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                    cos.size(1) == dim && cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous(),
                "paged_attention: cos and sin must be contiguous float32 [positions, head_dim]");
  const int64_t max_blocks = tables.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int32_t* table = tables.data_ptr<int32_t>();
  TORCH_CHECK(start[0] == 0 && start[seqs] == tokens, "paged_attention: starts must run from 0 to ", tokens);
  for (int64_t seq = 0; seq < seqs; ++seq) {
    TORCH_CHECK(start[seq + 1] > start[seq], "paged_attention: sequence ", seq, " has no token");
    const int64_t last = *std::max_element(pos + start[seq], pos + start[seq + 1]);
    TORCH_CHECK(*std::min_element(pos + start[seq], pos + start[seq + 1]) >= 0 && (!rope || last < cos.size(0)),
                "paged_attention: sequence ", seq, " has a position outside 0 .. ", rope ? cos.size(0) - 1 : last);
    TORCH_CHECK(last < max_blocks * block_size, "paged_attention: sequence ", seq, " at position ", last,
                " is past its ", max_blocks, " blocks");
    for (int64_t b = 0; b * block_size <= last; ++b)
      TORCH_CHECK(table[seq * max_blocks + b] >= 0 && table[seq * max_blocks + b] < blocks, "paged_attention: sequence ",
                  seq, " names block ", table[seq * max_blocks + b], " of ", blocks);
  }
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < blocks * block_size, "paged_attention: slot ", slot[t], " outside the cache");
  at::Tensor out = at::empty({tokens, heads * dim}, qkv.options());
  Kernel({qkv.data_ptr(), rope ? cos.data_ptr<float>() : nullptr, rope ? sin.data_ptr<float>() : nullptr, pos, slot,
          cache.data_ptr(), start, table, out.data_ptr(), tokens, seqs, heads, kv_heads, dim, blocks, block_size,
          max_blocks, static_cast<float>(scale), dtype});
  return out;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), what, " must be a contiguous [rows, columns]");
}

// x (or none) and residual [rows, cols], weight [cols], all of one dtype: residual += x, written in
// place; returns weight * RMSNorm(residual) [rows, cols].
template <void (*Kernel)(const AddRmsNorm&)>
at::Tensor add_rms_norm(const std::optional<at::Tensor>& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_rows(residual, "add_rms_norm: residual");
  const Dtype dtype = dtype_of(residual, "add_rms_norm");
  const int64_t rows = residual.size(0), cols = residual.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.is_contiguous() &&
                  weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: weight must be a contiguous [", cols, "] of the residual's dtype");
  if (x.has_value()) {
    check_rows(*x, "add_rms_norm: x");
    TORCH_CHECK(x->sizes() == residual.sizes() && x->scalar_type() == residual.scalar_type(),
                "add_rms_norm: x must match the residual's shape and dtype");
  }
  at::Tensor out = at::empty({rows, cols}, residual.options());
  Kernel({x.has_value() ? x->data_ptr() : nullptr, residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows,
          cols, static_cast<float>(eps), dtype});
  return out;
}

// gate_up [rows, 2 * cols] -> SiLU(gate_up[:, :cols]) * gate_up[:, cols:], [rows, cols].
template <void (*Kernel)(const SiluMul&)>
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even number of columns");
  const Dtype dtype = dtype_of(gate_up, "silu_mul");
  const int64_t rows = gate_up.size(0), cols = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, cols}, gate_up.options());
  Kernel({gate_up.data_ptr(), out.data_ptr(), rows, cols, dtype});
  return out;
}

}  // namespace
}  // namespace ferry

TORCH_LIBRARY(FERRY_OPS, m) {
  for (const char* isa : {"avx512", "avx2"})
    m.def((std::string("paged_attention_") + isa +
           "(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor(a!) cache, Tensor starts, "
           "Tensor tables, int heads, float scale) -> Tensor")
              .c_str());
  for (const char* isa : {"avx512", "avx2"}) {
    m.def((std::string("add_rms_norm_") + isa + "(Tensor? x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor")
              .c_str());
    m.def((std::string("silu_mul_") + isa + "(Tensor gate_up) -> Tensor").c_str());
  }
}

TORCH_LIBRARY_IMPL(FERRY_OPS, CPU, m) {
  m.impl("paged_attention_avx512", &ferry::paged_attention<ferry::avx512::paged_attention>);
  m.impl("paged_attention_avx2", &ferry::paged_attention<ferry::avx2::paged_attention>);
  m.impl("add_rms_norm_avx512", &ferry::add_rms_norm<ferry::avx512::add_rms_norm>);
  m.impl("add_rms_norm_avx2", &ferry::add_rms_norm<ferry::avx2::add_rms_norm>);
  m.impl("silu_mul_avx512", &ferry::silu_mul<ferry::avx512::silu_mul>);
  m.impl("silu_mul_avx2", &ferry::silu_mul<ferry::avx2::silu_mul>);
}
