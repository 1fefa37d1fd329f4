// paged_attention: one engine step's attention over the paged KV cache, read in place. What and
// why: workers/engine/cpu/kernels.py and docs/engine.md ("On a CPU"); the arguments: kernels.h and
// ops.cpp (cos and sin: the RoPE tables, sin's first half negated; a token at position p sees its
// sequence's keys 0 .. p).
//
// First each token's K, rotated, and V go to its slot; then each (sequence, KV head, tile of its
// tokens) task loads the tile's query rows rotated and scaled into float32, and walks the
// sequence's block table once: a block's keys and values are widened to float32, each row's
// scores are taken against its keys (a row at position p sees keys 0 .. p), and an online softmax
// folds them into the row's float32 accumulators. Nothing is gathered, padded or copied.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace ferry::FERRY_ISA {
namespace {

constexpr int64_t kTileRows = 32;  // query rows a task holds: its float32 state fits in L1 (ops.cpp checks)

struct Shape {
  int64_t heads, kv_heads, dim, blocks, block_size, width, max_blocks;
};

// x[d] * cos[d] + x[(d + dim / 2) % dim] * sin[d] (rotate-half RoPE), times scale, into float32.
template <typename T>
void rotate(const T* x, const float* cos, const float* sin, int64_t dim, float scale, float* out) {
  const int64_t half = dim / 2;
  if (cos == nullptr) {
    for (int64_t d = 0; d < dim; ++d) out[d] = to_float(x[d]) * scale;
    return;
  }
  for (int64_t d = 0; d < dim; ++d)
    out[d] = (to_float(x[d]) * cos[d] + to_float(x[(d + half) % dim]) * sin[d]) * scale;
}

template <typename T>
void write_cache(const T* qkv, const float* cos, const float* sin, const int64_t* positions, const int64_t* slots,
                 T* cache, int64_t tokens, const Shape& s) {
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(s.dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * s.width;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const T* k = row + (s.heads + h) * s.dim;
        const T* v = row + (s.heads + s.kv_heads + h) * s.dim;
        T* k_slot = cache + (h * s.blocks * s.block_size + slot) * s.dim;
        T* v_slot = cache + ((s.kv_heads + h) * s.blocks * s.block_size + slot) * s.dim;
        const int64_t p = positions[t];
        rotate(k, cos ? cos + p * s.dim : nullptr, sin ? sin + p * s.dim : nullptr, s.dim, 1.0f, rotated.data());
        for (int64_t d = 0; d < s.dim; ++d) store_scalar(k_slot + d, rotated[d]);
        std::copy(v, v + s.dim, v_slot);
      }
    }
  });
}

struct Task {
  int64_t seq, kv_head, first, count;  // tokens first .. first + count - 1 of the step
};

// One task: `rows` query rows (count tokens x group heads) against the sequence's blocks.
template <typename T, int64_t Chunks>
void attend_tile(const T* qkv, const float* cos, const float* sin, const int64_t* positions, const T* cache,
                 const int32_t* table, const Task& task, const Shape& s, float scale, T* out,
                 std::vector<float>& scratch) {
  constexpr int64_t L = Vec::kLanes;
  constexpr int64_t dim = Chunks * L;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t rows = task.count * group;
  const int64_t bs = s.block_size;
  const int64_t padded = (bs + L - 1) / L * L;
  scratch.resize(rows * dim * 2 + 2 * bs * dim + padded + 2 * rows);
  float* q = scratch.data();                   // [rows, dim] rotated, scaled queries
  float* acc = q + rows * dim;                 // [rows, dim] sum of p * v
  float* keys = acc + rows * dim;              // [bs, dim] the block's keys, float32
  float* values = keys + bs * dim;             // [bs, dim]
  float* p = values + bs * dim;                // [padded] one row's scores, then weights
  float* top = p + padded;                     // [rows] running max
  float* total = top + rows;                   // [rows] running sum of weights
  int64_t limit[kTileRows];                    // keys each row sees: its position + 1
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = task.first + r / group, h = task.kv_head * group + r % group;
    const int64_t pos = positions[t];
    limit[r] = pos + 1;
    rotate(qkv + t * s.width + h * dim, cos ? cos + pos * dim : nullptr, sin ? sin + pos * dim : nullptr, dim,
           scale, q + r * dim);
    top[r] = -std::numeric_limits<float>::infinity();
    total[r] = 0.0f;
    std::fill(acc + r * dim, acc + (r + 1) * dim, 0.0f);
  }
  const int64_t seen = *std::max_element(limit, limit + rows);
  const int64_t plane = s.blocks * bs * dim;  // K of one KV head to V of the same head: kv_heads planes
  for (int64_t b = 0; b * bs < seen; ++b) {
    const int64_t block = table[b];
    const int64_t n = std::min(bs, seen - b * bs);
    const T* k_src = cache + task.kv_head * plane + block * bs * dim;
    const T* v_src = cache + (s.kv_heads + task.kv_head) * plane + block * bs * dim;
    for (int64_t i = 0; i < n * Chunks; ++i) {
      Vec::load(k_src + i * L).store(keys + i * L);
      Vec::load(v_src + i * L).store(values + i * L);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t live = std::min(n, limit[r] - b * bs);  // a prefix of the block's keys
      if (live <= 0) continue;
      Vec qr[Chunks];
      for (int64_t c = 0; c < Chunks; ++c) qr[c] = Vec::load(q + r * dim + c * L);
      float peak = top[r];
      for (int64_t j = 0; j < live; ++j) {
        Vec dot = qr[0] * Vec::load(keys + j * dim);
        for (int64_t c = 1; c < Chunks; ++c) dot = fma(qr[c], Vec::load(keys + j * dim + c * L), dot);
        p[j] = dot.sum();
        peak = std::max(peak, p[j]);
      }
      for (int64_t j = live; j < padded; ++j) p[j] = -std::numeric_limits<float>::infinity();
      Vec sum = Vec::zero();
      for (int64_t j = 0; j < padded; j += L) {
        Vec e = exp(Vec::load(p + j) - Vec::all(peak));
        e.store(p + j);
      }
      for (int64_t j = live; j < padded; ++j) p[j] = 0.0f;  // exp clamps: masked keys weigh nothing
      for (int64_t j = 0; j < padded; j += L) sum = sum + Vec::load(p + j);
      const float shrink = std::exp(top[r] - peak);  // 0 on the first block (top is -inf)
      total[r] = total[r] * shrink + sum.sum();
      top[r] = peak;
      Vec a[Chunks];
      for (int64_t c = 0; c < Chunks; ++c) a[c] = Vec::load(acc + r * dim + c * L) * Vec::all(shrink);
      for (int64_t j = 0; j < live; ++j) {
        const Vec w = Vec::all(p[j]);
        for (int64_t c = 0; c < Chunks; ++c) a[c] = fma(w, Vec::load(values + j * dim + c * L), a[c]);
      }
      for (int64_t c = 0; c < Chunks; ++c) a[c].store(acc + r * dim + c * L);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = task.first + r / group, h = task.kv_head * group + r % group;
    const Vec inverse = Vec::all(1.0f / total[r]);
    for (int64_t c = 0; c < Chunks; ++c)
      (Vec::load(acc + r * dim + c * L) * inverse).store(out + t * s.heads * dim + h * dim + c * L);
  }
}

template <typename T, int64_t Chunks>
void attend(const T* qkv, const float* cos, const float* sin, const int64_t* positions, const T* cache,
            const int64_t* starts, const int32_t* tables, int64_t seqs, const Shape& s, float scale, T* out) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t tile = std::max<int64_t>(1, kTileRows / group);
  std::vector<Task> tasks;
  for (int64_t seq = 0; seq < seqs; ++seq)
    for (int64_t first = starts[seq]; first < starts[seq + 1]; first += tile)
      for (int64_t h = 0; h < s.kv_heads; ++h)
        tasks.push_back({seq, h, first, std::min(tile, starts[seq + 1] - first)});
  // The longest tiles (last in a prompt: they see the most keys) first, so threads end together.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return positions[a.first + a.count - 1] > positions[b.first + b.count - 1];
  });
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      attend_tile<T, Chunks>(qkv, cos, sin, positions, cache, tables + task.seq * s.max_blocks, task, s, scale,
                             out, scratch);
    }
  });
}

template <typename T>
void run(const ferry::PagedAttention& a, const Shape& s) {
  write_cache(static_cast<const T*>(a.qkv), a.cos, a.sin, a.positions, a.slots, static_cast<T*>(a.cache), a.tokens,
              s);
  auto kernel = [&](auto chunks) {
    attend<T, decltype(chunks)::value>(static_cast<const T*>(a.qkv), a.cos, a.sin, a.positions,
                                       static_cast<const T*>(a.cache), a.starts, a.tables, a.seqs, s, a.scale,
                                       static_cast<T*>(a.out));
  };
  switch (s.dim / Vec::kLanes) {  // ops.cpp takes head sizes of 16, 32, 64, 128 and 256
    case 1: return kernel(std::integral_constant<int64_t, 1>());
    case 2: return kernel(std::integral_constant<int64_t, 2>());
    case 4: return kernel(std::integral_constant<int64_t, 4>());
    case 8: return kernel(std::integral_constant<int64_t, 8>());
    case 16: return kernel(std::integral_constant<int64_t, 16>());
    case 32: return kernel(std::integral_constant<int64_t, 32>());
  }
}

}  // namespace

void paged_attention(const ferry::PagedAttention& a) {
  const Shape s{a.heads, a.kv_heads, a.dim, a.blocks, a.block_size, (a.heads + 2 * a.kv_heads) * a.dim, a.max_blocks};
  if (a.dtype == Dtype::kBFloat16)
    run<bf16>(a, s);
  else
    run<float>(a, s);
}

}  // namespace ferry::FERRY_ISA
