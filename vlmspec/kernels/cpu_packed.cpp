// y = x @ W.T + b over a copy of W in a packed layout, on CPUs with AVX-512 (AVX512-BF16 for
// bfloat16; AMX-BF16 tiles for bfloat16 where the CPU has them): the linears of the native step and
// the drafting round, and PackedLinear's "packed" backend (see vlmspec/kernels/cpu_kernels.py).
// cpu_linear.cpp holds the linears over W as stored.

#include "cpu_common.h"

#include <memory>
#include <mutex>
#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#endif

// AMX needs GCC 11 or later (its intrinsics and target names) and Linux's per-process permission
// (arch_prctl); elsewhere the tile path is not compiled and bfloat16 stays on AVX512-BF16.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && \
    __has_include(<sys/syscall.h>) && __has_include(<cpuid.h>)
#define VLMSPEC_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define VLMSPEC_AMX 0
#endif

namespace vlmspec_cpu {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace avx512 {
// ---- packed weights: 16 outputs per vector, no reductions ------------------------------
// In the [N, K] layout each output is a dot product that ends in a horizontal sum, and the
// 8-row tile above reads the big LM head at half the memory bandwidth. Packed, a block of 16
// outputs stores its weights k-major: one 64-byte vector per k (float32) or per pair of k
// (bfloat16, the pair vdpbf16ps multiplies), so a step loads one weight vector, broadcasts
// one activation (pair) per row of x, and adds into 16 outputs at once.
//   float32:  packed[b][k][i]         = W[16 b + i, k]            [N/16, K, 16]
//   bfloat16: packed[b][k2][i][j]     = W[16 b + i, 2 k2 + j]     [N/16, K/2, 16, 2]
// (N padded to 16 and K to 2 with zeros.)

constexpr int64_t kBlock = 16;

template <typename T>
struct Packed;
template <>
struct Packed<float> {
  static constexpr int64_t kPerStep = 1;  // k values a step consumes
  static __m512 weights(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 activation(const float* x, int64_t step) { return _mm512_set1_ps(x[step]); }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};
template <>
struct Packed<uint16_t> {
  static constexpr int64_t kPerStep = 2;
  static __m512 weights(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static __m512 activation(const uint16_t* x, int64_t step) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * step, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(w), (__m512bh)_mm512_castps_si512(x));
  }
};

// The epilogue of a tile: 16 float32 sums plus the bias, stored in the activations' dtype
// (bfloat16 rounded to nearest even, NaN to 0x7FC0, as c10::BFloat16 rounds): what the float32
// sums, ATen's bias add and its conversion gave, without a float32 output tensor and a second pass.
struct Epilogue {
  const float* bias_f32 = nullptr;     // one of these two, or neither
  const uint16_t* bias_bf16 = nullptr;
};
inline __m512 add_bias(const Epilogue& e, __m512 sums, int64_t n, __mmask16 mask) {
  if (e.bias_f32 != nullptr) return _mm512_add_ps(sums, _mm512_maskz_loadu_ps(mask, e.bias_f32 + n));
  if (e.bias_bf16 != nullptr) {
    const __m256i half = _mm256_maskz_loadu_epi16(mask, e.bias_bf16 + n);
    return _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
  return sums;
}
inline void store_out(float* out, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, v); }
inline void store_out(uint16_t* out, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(rounded));
}

// Calls with many rows: a step's multiply-adds then take as long as its 64 bytes of weights, the
// hardware prefetchers run too little ahead of the stream, and the loads' wait and the multiply-adds
// add up instead of overlapping. A software prefetch into L2, 8 KB ahead of the stream, restores the
// overlap. Measured on the 2-core Zen 4 EPYC over a whole target's packed linears (the reference's,
// LM head included), on and off in turn in one process, off/on: bfloat16 8 rows 1.16x, 12 rows 1.35x,
// 16 rows 1.42x; float32 8 rows 1.01-1.05x in a fast spell of memory and 1.66x in a slow one (19.8
// against 33.1 GB/s), 16 rows 1.22x. Below that it measured 0.94-0.99x (bfloat16 1-6 rows, float32
// 1-7), so fewer rows keep the hardware's prefetch alone. (In L1 or L2 the 8-row tile runs at 220 of
// the 233 GMAC/s of two cores' vdpbf16ps: the loss was the overlap.)
template <typename T>
constexpr int64_t kPrefetchFromRows = Packed<T>::kPerStep == 2 ? 7 : 8;
constexpr int64_t kPrefetchBytes = 8192;

// One block of 16 outputs against MR rows of x (rows ldx apart); steps = K / kPerStep. Every
// output is the same sequence of fused multiply-adds over k whatever MR is, so a row's result
// does not depend on the other rows of the call or on how the blocks were split.
template <int MR, typename T>
inline void packed_tile(const T* x, int64_t ldx, const T* w, int64_t steps, T* out, int64_t ldo, int64_t n0,
                        int64_t left, bool prefetch, const Epilogue& epilogue) {
  using P = Packed<T>;
  constexpr int64_t V = kBlock * P::kPerStep;  // elements of one weight vector
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t step = 0; step < steps; ++step) {
    if (prefetch)  // one 64-byte weight vector a step: one cache line each
      _mm_prefetch(reinterpret_cast<const char*>(w + step * V) + kPrefetchBytes, _MM_HINT_T1);
    const __m512 wv = P::weights(w + step * V);
    for (int m = 0; m < MR; ++m) acc[m] = P::fma(acc[m], wv, P::activation(x + m * ldx, step));
  }
  // left: outputs from n0 on that exist (the last block may be padding)
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, left)) - 1);
  for (int m = 0; m < MR; ++m) store_out(out + m * ldo, add_bias(epilogue, acc[m], n0, mask), mask);
}

// One block of 16 outputs (from n0) for all M rows of x, eight rows a tile.
template <typename T>
inline void packed_rows(const T* x, int64_t M, int64_t ldx, const T* w, int64_t steps, T* out, int64_t N, int64_t n0,
                        const Epilogue& epilogue) {
  const int64_t left = N - n0;
  const bool prefetch = M >= kPrefetchFromRows<T>;
  for (int64_t m = 0; m < M; m += 8) {
    const T* xm = x + m * ldx;
    T* om = out + m * N + n0;
    switch (std::min<int64_t>(8, M - m)) {
      case 8: packed_tile<8>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
      case 7: packed_tile<7>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
      case 6: packed_tile<6>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
      case 5: packed_tile<5>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
      case 4: packed_tile<4>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
      case 3: packed_tile<3>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
      case 2: packed_tile<2>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
      default: packed_tile<1>(xm, ldx, w, steps, om, N, n0, left, prefetch, epilogue); break;
    }
  }
}

// x [M, K] (K padded to kPerStep) times packed weights of N outputs, plus the bias: out [M, N] in T.
// Each thread takes one contiguous share of the blocks of 16 outputs (split_tasks) and reads it one
// block at a time, so that its share of the weights is one sequential stream; a block's MR rows of x
// are MR independent chains of multiply-adds, and at one row the bus, not the FMA latency, bounds
// the chain. Measured on the 2-core AVX-512 EPYC against the groups of four blocks (one row) or three
// (more) pulled in turn from a shared counter (split_dynamic) that this replaced, interleaved in one
// process: end to end the target alone 1.16-1.22x in bfloat16 and 1.21x in float32, the defaults
// 1.07-1.10x; every linear once at 2 / 4 / 8 rows 1.09 / 1.14 / 1.14x from the contiguous shares and
// a further 1.04 / 1.07 / 1.01x from one block at a time (docs/design.md §21.5). Blocks read side by
// side are streams that restart every 18 KB (bfloat16, K = 576), and chunks pulled in turn interleave
// the two threads' reads; the hardware prefetchers follow one stream a core better.
template <typename T>
void packed_linear(const T* x, int64_t M, int64_t K, const T* w, int64_t N, T* out, const Epilogue& epilogue) {
  const int64_t steps = K / Packed<T>::kPerStep, blocks = (N + kBlock - 1) / kBlock;
  const int64_t block_elems = steps * kBlock * Packed<T>::kPerStep;
  split_tasks(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      packed_rows(x, M, K, w + block * block_elems, steps, out, N, block * kBlock, epilogue);
  });
}
}  // namespace avx512

#pragma GCC pop_options

#if VLMSPEC_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

namespace amx {
// ---- bfloat16 on AMX tiles ----------------------------------------------------------------
// vdpbf16ps multiplies 16 outputs by one row of x per instruction: the 8-row tile
// above is compute-bound from about 8 rows (~115 GFLOPS a core on the AMX Xeon). A tile
// multiply (tdpbf16ps) takes 16 rows of x against 16 outputs over 32 k at once. The packed
// bfloat16 layout is already AMX's B-tile layout: 16 consecutive k-pair steps of one block
// are 16 rows of 64 bytes (16 outputs x one pair), so the weights load straight from it.
//   A tile (tmm4):     up to 16 rows of x x 32 bfloat16 (16 pairs), rows K * 2 bytes apart
//   B tiles (tmm5-7):  16 pair steps of one block, 64 bytes apart
//   C tiles (tmm0-3):  rows x 16 float32 sums, one per block: up to 4 blocks share each A load
// More than 16 rows run in chunks of 16 rows; the last chunk of a call whose rows are not a
// multiple of 16 ends at the last row and overlaps the one before it (one tile configuration a
// call; a row's sums do not depend on the others of its chunk, so the rows computed twice come out
// the same and are stored once). The weights of a group of blocks are read from memory by the
// first chunk and from the L2 cache by the next. (Two chunks against each weight tile, so that 32
// rows read the weights once, measured no faster, one thread, weights from memory: [3072, 576]
// 0.319 against 0.315 ms at 32 rows, 0.407 against 0.410 at 64; the LM head 4.86 against 4.93 at 32.) A K that is not a multiple of 32 ends in a partial
// chunk, copied with its weights into zeroed buffers; a padded block's outputs are not stored.
// Every bfloat16 call takes the tiles, from one row on: one row reads the weights as fast as
// vdpbf16ps does (one thread, weights from memory, shared machine: [3072, 576] 0.256 against
// 0.250 ms, the LM head [49152, 576] 3.86 against 3.87), and one path for every row count keeps a
// row's result independent of the rows that share its call (the two paths' sums differ in order).

constexpr int64_t kRows = 16;      // rows of x in a tile
constexpr int64_t kPairs = 16;     // k pairs in a tile (32 bfloat16, 64 bytes a row)
constexpr int64_t kStep = 32;      // bfloat16 values of one pair step of a block: 16 outputs x 2
constexpr int64_t kMaxBlocks = 4;  // C tiles: blocks of 16 outputs a thread takes at a time

// The 64-byte operand of ldtilecfg (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3 and tmm4: `height` rows of 64 bytes; tmm5-7: 16 rows of 64 bytes.
inline void configure_tiles(int64_t height) {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.colsb[tile] = 64;
    config.rows[tile] = static_cast<uint8_t>(tile < 5 ? height : kPairs);
  }
  _tile_loadconfig(&config);
}

// GCC's tile intrinsics are asm statements that do not tell the compiler they read or write memory:
// a fence between the plain stores into a buffer and a tile load from it (and between a tile store
// and plain loads) keeps them in order.
inline void memory_fence() { __asm__ __volatile__("" ::: "memory"); }

// C[b] += A x B[b] over one chunk of 16 pairs, for NB blocks `block_stride` bfloat16 apart.
template <int NB>
inline void multiply_chunk(const uint16_t* a, int64_t a_stride, const uint16_t* w, int64_t block_stride) {
  _tile_loadd(4, a, a_stride);
  _tile_loadd(5, w, 64);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (NB > 1) {
    _tile_loadd(6, w + block_stride, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  if constexpr (NB > 2) {
    _tile_loadd(7, w + 2 * block_stride, 64);
    _tile_dpbf16ps(2, 4, 7);
  }
  if constexpr (NB > 3) {
    _tile_loadd(5, w + 3 * block_stride, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// The partial last chunk of K, zero-padded: the weights of a group (copied once a group) and the
// x of a row chunk (copied once a chunk). The zeros beyond the tail are written once and stay.
struct KTail {
  int64_t pairs;  // steps % kPairs: 0 where K is a multiple of 32
  alignas(64) uint16_t w[kMaxBlocks * kPairs * kStep] = {};
  alignas(64) uint16_t x[kRows * kStep] = {};
};

// The float32 sums of NB blocks for `height` rows of x from x (rows K apart) and store them in
// sums [NB][16][16]. w: the group's first block, blocks steps * kStep apart.
template <int NB>
inline void tile_sums(const uint16_t* x, int64_t K, const uint16_t* w, int64_t steps, const KTail& tail,
                      float* sums) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const int64_t full = steps / kPairs, block_stride = steps * kStep;
  for (int64_t chunk = 0; chunk < full; ++chunk)
    multiply_chunk<NB>(x + chunk * 2 * kPairs, K * 2, w + chunk * kPairs * kStep, block_stride);
  if (tail.pairs > 0) multiply_chunk<NB>(tail.x, kStep * 2, tail.w, kPairs * kStep);
  constexpr int64_t tile_floats = kRows * 16;
  _tile_stored(0, sums, 64);
  if constexpr (NB > 1) _tile_stored(1, sums + tile_floats, 64);
  if constexpr (NB > 2) _tile_stored(2, sums + 2 * tile_floats, 64);
  if constexpr (NB > 3) _tile_stored(3, sums + 3 * tile_floats, 64);
  memory_fence();
}

// out [M, N] at outputs n0 .. n0 + 16 NB of the group's blocks, plus the bias, for all M rows.
template <int NB>
void tile_group(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t steps, KTail& tail,
                uint16_t* out, int64_t N, int64_t n0, const avx512::Epilogue& epilogue) {
  const int64_t height = std::min(M, kRows), full = steps / kPairs, left = N - n0;
  if (tail.pairs > 0) {
    for (int b = 0; b < NB; ++b)
      std::memcpy(tail.w + b * kPairs * kStep, w + (b * steps + full * kPairs) * kStep,
                  tail.pairs * kStep * sizeof(uint16_t));
  }
  alignas(64) float sums[kMaxBlocks * kRows * 16];
  for (int64_t first = 0, done = 0; done < M; first = std::min(done, M - height)) {
    const uint16_t* xc = x + first * K;
    if (tail.pairs > 0) {
      for (int64_t m = 0; m < height; ++m)
        std::memcpy(tail.x + m * kStep, xc + m * K + full * 2 * kPairs, tail.pairs * 2 * sizeof(uint16_t));
    }
    memory_fence();
    tile_sums<NB>(xc, K, w, steps, tail, sums);
    for (int b = 0; b < NB; ++b) {  // left: outputs of these blocks that exist (the last block may be padding)
      const int64_t valid = std::min<int64_t>(avx512::kBlock, left - b * avx512::kBlock);
      if (valid <= 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      const int64_t n = n0 + b * avx512::kBlock;
      for (int64_t m = done - first; m < height; ++m) {
        const __m512 v = _mm512_load_ps(sums + (b * kRows + m) * 16);
        avx512::store_out(out + (first + m) * N + n, avx512::add_bias(epilogue, v, n, mask), mask);
      }
    }
    done = first + height;
  }
}

// avx512::packed_linear for bfloat16 on tiles: the same split of blocks over the threads (groups
// of up to four blocks pulled from split_dynamic), each thread configuring its tiles for its
// share and releasing them after it, so that it runs alone and inside the native step's team.
void packed_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, uint16_t* out,
                   const avx512::Epilogue& epilogue) {
  const int64_t steps = K / 2, blocks = (N + avx512::kBlock - 1) / avx512::kBlock;
  split_dynamic(0, blocks, 8, kMaxBlocks, [&](int64_t begin, int64_t end) {
    configure_tiles(std::min(M, kRows));
    KTail tail;
    tail.pairs = steps % kPairs;
    for (int64_t first = begin; first < end;) {
      const int64_t count = std::min(kMaxBlocks, end - first), n0 = first * avx512::kBlock;
      const uint16_t* wg = w + first * steps * kStep;
      if (count == 4) tile_group<4>(x, M, K, wg, steps, tail, out, N, n0, epilogue);
      else if (count == 3) tile_group<3>(x, M, K, wg, steps, tail, out, N, n0, epilogue);
      else if (count == 2) tile_group<2>(x, M, K, wg, steps, tail, out, N, n0, epilogue);
      else tile_group<1>(x, M, K, wg, steps, tail, out, N, n0, epilogue);
      first += count;
    }
    _tile_release();
  });
}
}  // namespace amx

#pragma GCC pop_options

// Whether this CPU has AMX-BF16 tiles (CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE) and Linux
// lets this process use them: the tile data is a dynamically enabled state that a process must ask for
// once (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); refused (an old kernel), the tiles stay off.
bool request_amx_tiles() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (((edx >> 22) & 1) == 0 || ((edx >> 24) & 1) == 0) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#else
bool request_amx_tiles() { return false; }
#endif

}  // namespace

bool kernel_uses_amx() {
  static const bool granted = request_amx_tiles();  // asked once per process
  return granted && cpu_has_avx512_bf16() && !isa_held_to("avx512_bf16");
}

namespace {

// ---- packed weights on 2 MB pages ---------------------------------------------------------
// A pass over the packed weights streams a few hundred MB through 4 KB pages, where the TLB and
// the prefetchers restart every page: on the 2-core AVX-512 EPYC a one-row pass over the
// reference target read at ~30 GB/s, and at ~38 from the same weights on transparent huge pages
// (8 rows: 23 against 29). So the packed copies are carved out of 2 MB-aligned chunks advised
// MADV_HUGEPAGE (the kernel's THP setting is usually "madvise"); a chunk is freed with the last
// weight in it. Elsewhere (no Linux madvise) the advice is simply absent.
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kChunk = size_t{32} << 20;

struct HugeChunk {
  char* base;
  size_t size;
  explicit HugeChunk(size_t bytes) : size((bytes + kHugePage - 1) / kHugePage * kHugePage) {
    base = static_cast<char*>(std::aligned_alloc(kHugePage, size));
    TORCH_CHECK(base != nullptr, "pack_weight: out of memory for ", size, " bytes");
#ifdef MADV_HUGEPAGE
    madvise(base, size, MADV_HUGEPAGE);
#endif
  }
  ~HugeChunk() { std::free(base); }
  HugeChunk(const HugeChunk&) = delete;
  HugeChunk& operator=(const HugeChunk&) = delete;
};

// An uninitialised tensor on huge pages; weights share 32 MB chunks, a larger one has its own.
at::Tensor empty_on_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
  static std::mutex mutex;
  static std::weak_ptr<HugeChunk> current;  // the chunk being filled, while any weight in it lives
  static size_t used = 0;
  int64_t numel = 1;
  for (int64_t size : sizes) numel *= size;
  const size_t bytes = std::max<size_t>(static_cast<size_t>(numel) * options.dtype().itemsize(), 1);
  const size_t rounded = (bytes + 63) / 64 * 64;
  std::shared_ptr<HugeChunk> chunk;
  char* data;
  if (rounded > kChunk / 2) {
    chunk = std::make_shared<HugeChunk>(rounded);
    data = chunk->base;
  } else {
    std::lock_guard<std::mutex> lock(mutex);
    chunk = current.lock();
    if (!chunk || used + rounded > chunk->size) {
      chunk = std::make_shared<HugeChunk>(kChunk);
      current = chunk;
      used = 0;
    }
    data = chunk->base + used;
    used += rounded;
  }
  return at::from_blob(data, sizes, [chunk](void*) mutable { chunk.reset(); }, options);
}

}  // namespace

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_weight: weight [N, K] expected, got ", weight.sizes());
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || weight.scalar_type() == at::kFloat, "pack_weight: float32 or bfloat16, got ",
              weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1), per_step = bf16 ? 2 : 1;
  const int64_t blocks = (N + avx512::kBlock - 1) / avx512::kBlock, steps = (K + per_step - 1) / per_step;
  // [blocks, 16, steps, per_step] padded, then k-steps outermost within a block.
  at::Tensor padded = at::zeros({blocks * avx512::kBlock, steps * per_step}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  at::Tensor packed = empty_on_huge_pages({blocks, steps, avx512::kBlock, per_step}, weight.options());
  packed.copy_(padded.view({blocks, avx512::kBlock, steps, per_step}).permute({0, 2, 1, 3}));
  return packed;
}

void packed_linear_into(const at::Tensor& packed, int64_t out_features, const at::Tensor* bias, const void* x,
                        int64_t M, void* out) {
  const int64_t K = packed.size(1) * packed.size(3);
  avx512::Epilogue epilogue;
  if (bias != nullptr) {
    if (bias->scalar_type() == at::kFloat) epilogue.bias_f32 = bias->data_ptr<float>();
    else epilogue.bias_bf16 = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  if (packed.scalar_type() == at::kBFloat16 && kernel_uses_amx()) {
#if VLMSPEC_AMX
    amx::packed_linear(static_cast<const uint16_t*>(x), M, K,
                       reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), out_features,
                       static_cast<uint16_t*>(out), epilogue);
#endif
  } else if (packed.scalar_type() == at::kBFloat16) {
    avx512::packed_linear(static_cast<const uint16_t*>(x), M, K,
                          reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), out_features,
                          static_cast<uint16_t*>(out), epilogue);
  } else {
    avx512::packed_linear(static_cast<const float*>(x), M, K, packed.data_ptr<float>(), out_features,
                          static_cast<float*>(out), epilogue);
  }
}

bool packed_linear_bias_ready(const at::Tensor& packed, const at::Tensor& bias) {
  return bias.is_contiguous() && (bias.scalar_type() == packed.scalar_type() || bias.scalar_type() == at::kFloat);
}

at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == avx512::kBlock && x.dim() == 2,
              "packed_linear: x [M, K] and a weight from pack_weight expected");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "packed_linear: x must have the packed weight's dtype, got ",
              x.scalar_type(), " and ", packed.scalar_type());
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 ? cpu_has_avx512_bf16() : cpu_has_avx512(), "packed_linear: needs ",
              bf16 ? "AVX512-BF16" : "AVX-512", " (check kernel_isa() before packing)");
  const int64_t M = x.size(0), per_step = packed.size(3), K = packed.size(1) * per_step;
  TORCH_CHECK(x.size(1) <= K && x.size(1) > K - per_step && out_features <= packed.size(0) * avx512::kBlock,
              "packed_linear: x has ", x.size(1), " inputs, the packed weight ", K);
  at::Tensor xc = x.contiguous();
  if (x.size(1) != K) xc = at::constant_pad_nd(xc, {0, K - x.size(1)});  // an odd K: pad the last pair
  at::Tensor out = at::empty({M, out_features}, x.options());
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out_features, "packed_linear: bias of ", out_features, " values expected");
    b = packed_linear_bias_ready(packed, *bias) ? *bias : bias->to(at::kFloat).contiguous();
  }
  packed_linear_into(packed, out_features, bias.has_value() ? &b : nullptr, xc.data_ptr(), M, out.data_ptr());
  return out;
}

}  // namespace vlmspec_cpu
