// torch.ops.ferry.decode_attention: one decode token per sequence attending to its context, in
// bfloat16 on an AVX-512 CPU. What and why: workers/engine/cpu/decode_kernel.py.
//
//   query   [seqs, kv_heads, group, head_dim]  bfloat16: a KV head's query heads as its rows
//   keys    [seqs, kv_heads, keys, head_dim]   bfloat16, any strides with head_dim contiguous
//   values  like keys
//   lengths [seqs] int64: sequence s sees keys 0 .. lengths[s] - 1, the rest is padding
//   -> [seqs, kv_heads, group, head_dim] float32
//
// One task per (sequence, KV head), spread over torch's intra-op threads: the task reads that
// head's keys once for all of its query rows (scores in float32, a max-subtracted softmax with a
// vectorised exp), then its values once, accumulating in float32. Nothing past a sequence's
// length is read, so a padded group costs what its real contexts hold.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;      // floats in one AVX-512 register
constexpr int64_t kMaxRows = 16;    // query heads per KV head
constexpr int64_t kMaxChunks = 16;  // head_dim / kLanes, so head_dim <= 256

inline __m512 load_bf16(const at::BFloat16* p) {
  // bfloat16 is the upper half of a float32: widen each 16-bit lane and shift it up.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 exp512(__m512 x) {
  // exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by Cephes'
  // degree-6 polynomial (float32-exact to about one ulp); below -87 it underflows to 0.
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

template <int64_t Chunks>
void attend_head(const at::BFloat16* query, const at::BFloat16* keys, const at::BFloat16* values,
                 int64_t key_stride, int64_t value_stride, int64_t rows, int64_t length, float scale,
                 float* scores, float* out) {
  constexpr int64_t dim = Chunks * kLanes;
  __m512 q[kMaxRows][Chunks];
  for (int64_t g = 0; g < rows; ++g)
    for (int64_t c = 0; c < Chunks; ++c)
      q[g][c] = _mm512_mul_ps(load_bf16(query + g * dim + c * kLanes), _mm512_set1_ps(scale));

  float top[kMaxRows];
  for (int64_t g = 0; g < rows; ++g) top[g] = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < length; ++t) {
    __m512 k[Chunks];
    for (int64_t c = 0; c < Chunks; ++c) k[c] = load_bf16(keys + t * key_stride + c * kLanes);
    for (int64_t g = 0; g < rows; ++g) {
      __m512 dot = _mm512_mul_ps(q[g][0], k[0]);
      for (int64_t c = 1; c < Chunks; ++c) dot = _mm512_fmadd_ps(q[g][c], k[c], dot);
      const float score = _mm512_reduce_add_ps(dot);
      scores[g * length + t] = score;
      top[g] = score > top[g] ? score : top[g];
    }
  }

  float inverse[kMaxRows];
  for (int64_t g = 0; g < rows; ++g) {
    float* row = scores + g * length;
    const __m512 peak = _mm512_set1_ps(top[g]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += kLanes) {
      const __mmask16 live = length - t >= kLanes ? 0xffff : (__mmask16)((1u << (length - t)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + t), peak));
      _mm512_mask_storeu_ps(row + t, live, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
    }
    inverse[g] = 1.0f / _mm512_reduce_add_ps(total);
  }

  __m512 acc[kMaxRows][Chunks];
  for (int64_t g = 0; g < rows; ++g)
    for (int64_t c = 0; c < Chunks; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; ++t) {
    __m512 v[Chunks];
    for (int64_t c = 0; c < Chunks; ++c) v[c] = load_bf16(values + t * value_stride + c * kLanes);
    for (int64_t g = 0; g < rows; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * length + t]);
      for (int64_t c = 0; c < Chunks; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < rows; ++g)
    for (int64_t c = 0; c < Chunks; ++c)
      _mm512_storeu_ps(out + g * dim + c * kLanes, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inverse[g])));
}

using HeadKernel = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t, int64_t,
                            int64_t, int64_t, float, float*, float*);

HeadKernel head_kernel(int64_t head_dim) {
  switch (head_dim) {  // the head sizes of the models ferry runs, and of its tests' tiny ones
    case 16: return attend_head<1>;
    case 32: return attend_head<2>;
    case 64: return attend_head<4>;
    case 128: return attend_head<8>;
    case 256: return attend_head<16>;
    default: return nullptr;
  }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4,
              "decode_attention: query, keys and values must be 4-D");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16,
              "decode_attention: bfloat16 query, keys and values expected");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() &&
                  lengths.device().is_cpu(),
              "decode_attention: CPU tensors expected");
  const int64_t seqs = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  TORCH_CHECK(keys.size(0) == seqs && keys.size(1) == heads && keys.size(3) == dim &&
                  keys.sizes() == values.sizes(),
              "decode_attention: keys and values must be [seqs, kv_heads, keys, head_dim] like query");
  const HeadKernel kernel = head_kernel(dim);
  TORCH_CHECK(kernel != nullptr, "decode_attention: head_dim must be 16, 32, 64, 128 or 256, got ", dim);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "decode_attention: 1 to ", kMaxRows,
              " query rows per KV head, got ", rows);
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: head_dim must be contiguous");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.size(0) == seqs,
              "decode_attention: lengths must be int64 [seqs]");
  const at::Tensor q = query.contiguous();
  const at::Tensor length = lengths.contiguous();
  const int64_t* length_of = length.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK(length_of[s] >= 1 && length_of[s] <= keys.size(2), "decode_attention: lengths[", s, "] = ",
                length_of[s], " is outside 1 ..", keys.size(2));
  at::Tensor out = at::empty({seqs, heads, rows, dim}, query.options().dtype(at::kFloat));
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = keys.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = values.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  const float factor = static_cast<float>(scale);
  at::parallel_for(0, seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rows * keys.size(2));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads;
      kernel(qp + task * rows * dim, kp + s * keys.stride(0) + h * keys.stride(1),
             vp + s * values.stride(0) + h * values.stride(1), keys.stride(2), values.stride(2), rows,
             length_of[s], factor, scores.data(), op + task * rows * dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ferry, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry, CPU, m) { m.impl("decode_attention", &decode_attention); }
