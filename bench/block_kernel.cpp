// A design candidate measured by bench/block_kernel.py, not part of the product: pooled SUM lookups of tables held
// in two precision blocks (INT8 hot rows, INT4 cold rows, dim 128) in ONE pass — each id's remap entry read, the row
// pooled from whichever block holds it, one output column range per feature — instead of the served path's remap
// op, block split op, a TBE call over both levels and the add of the levels (infer/modules/collection.py).
// It reads the served model's own TBE buffers: fbgemm's rows, fp16 scale and bias first, then the quantized bytes.
#include <torch/extension.h>

#include <cstring>
#include <immintrin.h>

namespace {

constexpr int64_t kDim = 128;
constexpr int64_t kAhead = 16;  // rows prefetched ahead; the remap twice as far

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ids/offsets: the request (feature-major bags); remap: every block table's id -> position (cold rows first, then
// hot), remap_offsets per feature; cold_rows per feature (positions >= it are hot); hot/cold: per feature the
// address of row 0 of its table's INT8 and INT4 blocks in the TBE buffer; strides: bytes per row of each.
torch::Tensor pool_blocks(torch::Tensor ids, torch::Tensor offsets, torch::Tensor remap, torch::Tensor remap_offsets,
                          torch::Tensor cold_rows, torch::Tensor hot, torch::Tensor cold, int64_t hot_stride,
                          int64_t cold_stride) {
  TORCH_CHECK(ids.dtype() == torch::kInt64 && offsets.dtype() == torch::kInt64, "int64 ids and offsets");
  TORCH_CHECK(remap.dtype() == torch::kInt32 && cold_rows.dtype() == torch::kInt32, "int32 remap and cold_rows");
  const int64_t features = cold_rows.numel();
  const int64_t batch = (offsets.numel() - 1) / features;
  auto out = torch::empty({batch, features * kDim}, torch::kFloat32);
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int32_t* map = remap.data_ptr<int32_t>();
  const int64_t* map_off = remap_offsets.data_ptr<int64_t>();
  const int32_t* bound = cold_rows.data_ptr<int32_t>();
  const int64_t* hot_base = hot.data_ptr<int64_t>();
  const int64_t* cold_base = cold.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const __m128i nibble = _mm_set1_epi16(0x0F);
  for (int64_t f = 0; f < features; ++f) {
    const int32_t* table = map + map_off[f];
    const int32_t t = bound[f];
    const auto* hot_rows = reinterpret_cast<const uint8_t*>(hot_base[f]);
    const auto* cold_rows_f = reinterpret_cast<const uint8_t*>(cold_base[f]);
    const int64_t last = off[(f + 1) * batch];
    auto row_of = [&](int64_t position) {
      return position >= t ? hot_rows + (position - t) * hot_stride : cold_rows_f + position * cold_stride;
    };
    for (int64_t b = 0; b < batch; ++b) {
      __m512 acc[kDim / 16];
      for (auto& a : acc) a = _mm512_setzero_ps();
      float bias = 0.f;
      for (int64_t i = off[f * batch + b]; i < off[f * batch + b + 1]; ++i) {
        if (i + 2 * kAhead < last) _mm_prefetch(reinterpret_cast<const char*>(table + id[i + 2 * kAhead]), _MM_HINT_T0);
        if (i + kAhead < last) {
          const auto* ahead = reinterpret_cast<const char*>(row_of(table[id[i + kAhead]]));
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
          _mm_prefetch(ahead + 128, _MM_HINT_T0);
        }
        const int32_t position = table[id[i]];
        const uint8_t* row = row_of(position);
        const __m512 scale = _mm512_set1_ps(half_to_float(row));
        bias += half_to_float(row + 2);
        const uint8_t* q = row + 4;
        if (position >= t) {
          for (int k = 0; k < kDim / 16; ++k) {
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * k));
            acc[k] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), acc[k]);
          }
        } else {
          for (int k = 0; k < kDim / 16; ++k) {  // 8 bytes: 16 values, the low nibble first
            const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k)));
            const __m128i both =
                _mm_or_si128(_mm_and_si128(wide, nibble), _mm_slli_epi16(_mm_srli_epi16(wide, 4), 8));
            acc[k] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both)), acc[k]);
          }
        }
      }
      const __m512 total_bias = _mm512_set1_ps(bias);
      float* dst = o + b * features * kDim + f * kDim;
      for (int k = 0; k < kDim / 16; ++k) _mm512_storeu_ps(dst + 16 * k, _mm512_add_ps(acc[k], total_bias));
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("pool_blocks", &pool_blocks); }
