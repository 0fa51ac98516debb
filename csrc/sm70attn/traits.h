// Tile constants of the attention kernel, one place. Everything below is derived from
// (head dim D, row blocks MB of 16 query rows per CTA, KV load width VEC bytes).
#pragma once

#include "sm70attn/registry.h"

namespace sm70attn {

// Largest MB one CTA takes; more rows are split into row groups (KV read once per group).
// D=256 stops at 4 (64 rows): Q + K + V + S tiles take 84 KB there, 128 rows would not fit
// the 96 KB of shared memory.
__host__ __device__ constexpr int attn_max_row_blocks(int d) { return d == 256 ? 4 : 8; }

// KV tokens per tile. 32 keeps the fp16 K+V tiles at 9/17/34 KB for D=64/128/256 so several
// CTAs share an SM; the register-staged e4m3 tile (4/8/16 KB per CTA in flight) covers V100's
// ~7 KB per SM of bandwidth x latency. D=64 with few rows takes 64, and so does D=256 verify
// with 2-3 row blocks (one CTA per SM anyway): its per-tile costs (barriers, softmax row
// reductions, the O rescale) are then paid once per 64 tokens, and S (which must share the K
// tile's memory at MB = 3 to fit 96 KB) needs no partial buffers.
__host__ __device__ constexpr int attn_tile_tokens(int d, int mb) {
  return (d == 64 && mb <= 2) || (d == 256 && (mb == 2 || mb == 3)) ? 64 : 32;
}

// Warps sharing one 16-row block: the CTA has MB * WN warps; warp w owns row block w / WN
// (its softmax rows and its output accumulators) and 1/WN of the S and O column tiles.
__host__ __device__ constexpr int attn_warps_per_row_block(int d, int mb) {
  const int for_cta = mb == 1 ? 4 : mb <= 3 ? 2 : 1;  // at least 4 warps per CTA
  const int for_regs = d / 64;                         // at most 4 O tiles (32 fp32 registers) per warp
  return for_cta > for_regs ? for_cta : for_regs;
}

__host__ __device__ constexpr int pow2_floor(int x) { return x >= 2 ? 2 * pow2_floor(x / 2) : 1; }

template <int D_, int MB_, int VEC_>
struct AttnTraits {
  static constexpr int D = D_;      // head dim
  static constexpr int MB = MB_;    // 16-row blocks per CTA
  static constexpr int VEC = VEC_;  // bytes per KV global load (16, or 8 for 8-byte aligned caches)
  static constexpr int ROWS = 16 * MB;
  static constexpr int N = attn_tile_tokens(D, MB);  // KV tokens per tile
  static constexpr int DB = D / 16, NB = N / 16;      // 16-wide column tiles of O and S
  static constexpr int WN = attn_warps_per_row_block(D, MB);
  static constexpr int WARPS = MB * WN, THREADS = 32 * WARPS;
  // QK^T: when a row block has more warps than S tiles (WN > NB), KS = WN / NB warps share each
  // S tile, each summing DB / KS of the 16-wide D slices into its own fp32 S buffer; the softmax
  // adds the KS partial scores in buffer order (fixed: deterministic). Otherwise warps split the
  // S tiles, SPW each.
  // Only D = 256 (16 slices): at D = 128 the second S buffer would cost D128 MB1 a CTA per SM.
  static constexpr int KS = D == 256 && WN > NB ? WN / NB : 1;
  static constexpr int WNS = WN / KS;               // warps across the S tiles of a row block
  static constexpr int SPW = (NB + WNS - 1) / WNS;  // S tiles per warp
  static constexpr int DPK = DB / KS;               // D slices per warp in QK^T
  static constexpr int DPW = DB / WN;             // O tiles per warp, kept in registers

  // KV gather: a tile is N rows of D bytes; CPT chunks of VEC bytes per row.
  // TPK threads per token (a power of two dividing CPT, at most THREADS / N), each loading LPT
  // chunks of its token; the first ACTIVE = N * TPK threads gather.
  static constexpr int CPT = D / VEC;
  static constexpr int TPK = pow2_floor(THREADS / N < CPT ? THREADS / N : CPT);
  static constexpr int LPT = CPT / TPK, ACTIVE = N * TPK;  // loads per thread per tensor

  // Shared memory (leading dims in elements). +8 halves / +4 floats of padding make the row
  // stride 16 bytes mod 128: conflict-free WMMA loads/stores. P (fp16) overwrites the first
  // half of each S (fp32) row in place, so its leading dim is 2 * SLD halves; the row's O
  // rescale factor, 16 copies, goes to floats [N/2, N/2 + 16) of the same row.
  // S_ALIAS: the KS partial S buffers do not fit beside Q, K and V in 96 KB, so they take the
  // K tile's place once every warp is done with K (one more barrier per tile; D256 MB3 only).
  static constexpr int QLD = D + 8, KLD = D + 8, SLD = N + 4, PLD = 2 * SLD, ELD = D + 4;
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + ROWS * QLD * 2;
  static constexpr int V_OFF = K_OFF + N * KLD * 2;
  static constexpr int KV_END = V_OFF + N * KLD * 2;
  static constexpr int S_BYTES = KS * ROWS * SLD * 4;  // KS partial S buffers
  static constexpr bool S_ALIAS = KV_END + S_BYTES + 2 * ROWS * 4 + N * 4 + 16 > 96 * 1024;
  static constexpr int S_OFF = S_ALIAS ? K_OFF : KV_END;
  static constexpr int LOOP_BYTES = S_ALIAS ? KV_END : KV_END + S_BYTES;
  static constexpr int EPI_BYTES = ROWS * ELD * 4;  // fp32 O staged for the epilogue (aliases all above)
  static constexpr int ROW_OFF = LOOP_BYTES > EPI_BYTES ? LOOP_BYTES : EPI_BYTES;
  static constexpr int TOK_OFF = ROW_OFF + 2 * ROWS * 4;  // after row max, row sum
  static constexpr int FLAG_OFF = TOK_OFF + N * 4;         // + per-token "page valid" flags
  static constexpr int SMEM_BYTES = FLAG_OFF + (WARPS + 7) / 8 * 8;  // + per-warp "a row max moved" bytes
  // __launch_bounds__ min blocks: as many CTAs per SM as shared memory allows (96 KB, SM70), but
  // never a register budget under 128 per thread (65536 / (128 * THREADS) CTAs). Decode (MB = 1,
  // 4 warps) asks for at least 3 (<= 168 registers): SMs with more shared memory (SM80+) then hold
  // 12 warps, and the plan sizes its splits from the occupancy the launcher measures.
  static constexpr int SMEM_BLOCKS = 96 * 1024 / SMEM_BYTES;
  static constexpr int REG_BLOCKS = 512 / THREADS > 0 ? 512 / THREADS : 1;
  static constexpr int FIT_BLOCKS = SMEM_BLOCKS < REG_BLOCKS ? SMEM_BLOCKS : REG_BLOCKS;
  static constexpr int WANT_BLOCKS = MB == 1 && FIT_BLOCKS < 3 ? 3 : FIT_BLOCKS;
  static constexpr int MIN_BLOCKS = WANT_BLOCKS < REG_BLOCKS ? WANT_BLOCKS : REG_BLOCKS;
  // A register budget 65536 / (THREADS * MIN_BLOCKS) of >= 160 (ROOMY) lets the QK^T loop over
  // the D slices unroll fully (constant shared-memory offsets; else by 4; in two chunks of 8
  // from stepped pointers where 16 slices and more than 256 threads per SM would spill: D256
  // MB3; paged_attention.cuh) and, with at most two softmax
  // passes per warp, the softmax keep its row state in registers (else shared memory): no
  // spills on SM70 either way.
  static constexpr bool ROOMY = 65536 / (THREADS * MIN_BLOCKS) >= 160;
  static constexpr int QK_UNROLL = ROOMY ? (DPK > 8 && THREADS * MIN_BLOCKS > 256 ? 8 : DPK) : 4;

  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static_assert(MB >= 1 && MB <= attn_max_row_blocks(D), "row blocks");
  static_assert(VEC == 8 || VEC == 16, "load width");
  static_assert(N == 32 || N == 64, "softmax: 8 lanes per row, N / 8 tokens per lane");
  static_assert(!S_ALIAS || S_BYTES <= N * KLD * 2, "S fits in the K tile");
  static_assert(16 % WN == 0 && DB % WN == 0, "row and column split over WN warps");
  static_assert(WN % KS == 0 && DB % KS == 0 && (KS == 1 || NB % WNS == 0), "QK^T split over D");
  static_assert(DPW <= 4, "fp32 O accumulators per thread (registers)");
  static_assert(!ROOMY || DPK % QK_UNROLL == 0, "QK^T: whole chunks of slices");
  static_assert(WARPS <= 16, "threads per CTA");
  static_assert(CPT % TPK == 0 && ACTIVE <= THREADS, "gather layout");
  static_assert(S_OFF % 32 == 0 && V_OFF % 32 == 0 && N * 2 % 32 == 0, "WMMA 256-bit alignment");
  static_assert(SMEM_BYTES <= 96 * 1024, "SM70 shared memory per block");
};

// D = 256 verify (2-3 row blocks) has a register-fragment kernel too (paged_attention_rf.cuh):
// by default where attn_default_kind says, else through set_kernel_override (tests, A/B runs).
__host__ __device__ constexpr bool attn_uses_rf(int d, int mb) { return d == 256 && (mb == 2 || mb == 3); }

// Which attention kernel a call runs: the WMMA kernel (paged_attention.cuh), or the
// register-fragment one (paged_attention_rf.cuh) on m8n8k4 (SM70's atom; newer GPUs run it as
// ptxas emulates it) or on m16n8k16 (SM80+). A kind is its kernel's family (registry.h: ATTN_WMMA,
// ATTN_RF_M8N8K4, ATTN_RF_M16N8K16, the first kAttnKinds families).
using AttnKind = Family;

// The kind a call takes unless set_kernel_override says otherwise, on a GPU of compute
// capability cc (10 major + minor) with a cache of `capacity` tokens per request (a shape: never
// B or the lengths, so a request's bits do not depend on its batch): the register-fragment
// kernel for D = 256 on SM 7.0 (V100: not 7.2/7.5, whose shared memory differs) in CTAs of 2 row
// blocks (17-32 query rows a KV head: the seeds' G 6 x Q 4) from 64K tokens and of 3 (33-48: G 6
// x Q 8, or row groups of those) from 128K, where the V100 model predicts it faster than the
// WMMA kernel at every batch (two CTAs per SM against one). Below, a plan of a little over one
// CTA with work per SM puts two on a few SMs while the WMMA kernel has one on each, and the
// RF kernel is slower at small batches (predicted up to 1.2x for MB2 at 33K, 1.5x for MB3 at
// 64K). Elsewhere the WMMA kernel: on the H200 the m16n8k16 twin measured slower in most
// cells. Figures: docs/perf.md, "The register-fragment kernel".
__host__ __device__ constexpr int attn_default_kind(int d, int mb, int cc, long long capacity) {
  return cc == 70 && d == 256 && ((mb == 2 && capacity >= 65536) || (mb == 3 && capacity >= 131072)) ? ATTN_RF_M8N8K4 : ATTN_WMMA;
}

// The register-fragment kernel's tile: ROWS = 16 MB query rows, 32-token tiles, 4 warps per
// 16-row block. Warp w takes row block rb = w / 4 and, as tg = w % 4, tokens [8 tg, 8 tg + 8)
// of each tile in QK^T (S over all of D: one 16x8 block in registers) and columns
// [64 tg, 64 tg + 64) of O in PV (32 fp32 registers a lane). V is stored over K once every warp
// is done with K, so shared memory holds Q, one tile and P: <= 48 KB, room for two CTAs in 96 KB.
template <int D_, int MB_, int VEC_>
struct AttnRfTraits {
  static constexpr int D = D_, MB = MB_, VEC = VEC_;
  static constexpr int ROWS = 16 * MB, N = 32, TG = 4, WARPS = TG * MB, THREADS = 32 * WARPS;
  static constexpr int DW = D / TG;  // O columns per warp
  // KV gather (kv_tile.h), as AttnTraits
  static constexpr int CPT = D / VEC;
  static constexpr int TPK = pow2_floor(THREADS / N < CPT ? THREADS / N : CPT);
  static constexpr int LPT = CPT / TPK, ACTIVE = N * TPK;
  // Leading dims (halves). A tile row (K or V) is D + 8: 16 bytes mod 128, so the gather's
  // 16-byte stores are conflict-free, and so are m8n8k4's 16-byte fragment loads (the 8 lanes of
  // a phase read 4 rows at 2 offsets 64 bytes apart: K's two D halves, V's two column blocks).
  // Q is stored in groups of 8 rows, Q_GROUP apart (2 banks more than 8 rows): its fragments
  // are 8-byte loads (16-byte ones would spill on sm_70), of which a half-warp reads 16 distinct
  // bank pairs (4 rows x 2 row groups x 2 D halves, the second half starting 32 columns on:
  // paged_attention_rf.cuh). P rows are N + 4 (18 banks apart).
  static constexpr int QLD = D + 8, Q_GROUP = 8 * QLD + 4, KLD = D + 8, PLD = N + 4, ELD = D / 2 + 4;
  // The online softmax's lazy rescale: m moves when a tile's maximum passes it by more than
  // this (log2 units).
  static constexpr float RESCALE_LOG2 = 8.f;
  static constexpr int Q_OFF = 0;
  static constexpr int T_OFF = (2 * MB * Q_GROUP * 2 + 127) / 128 * 128;  // [N][KLD]: K, then V
  static constexpr int P_OFF = T_OFF + N * KLD * 2;                       // [ROWS][PLD] fp16
  static constexpr int RED_OFF = P_OFF + ROWS * PLD * 2;  // [ROWS][TG] fp32: maxima, then sums
  static constexpr int TOK_OFF = RED_OFF + ROWS * TG * 4;  // [N] "page valid" flags
  static constexpr int ML_OFF = TOK_OFF + N * 4;           // row max, row sum (epilogue)
  static constexpr int LAST_OFF = ML_OFF + 2 * ROWS * 4;   // [ROWS] last visible token per row
  static constexpr int META_OFF = LAST_OFF + ROWS * 4;     // 6 CTA values (8 bytes each)
  static constexpr int SMEM_BYTES = META_OFF + 48;
  static constexpr int EPI_BYTES = ROWS * ELD * 4;  // fp32 O, half of D at a time (aliases Q)
  // Two CTAs per SM70 SM: <= 80 registers a thread at 384 threads, which sm_70's m8n8k4 build
  // meets without spills (and sm_90a's m16n8k16 twin), because the tile loop keeps little
  // besides O in registers (paged_attention_rf.cuh). MB2 (256 threads) gets up to 128.
  static constexpr int MIN_BLOCKS = 2;
  static_assert(attn_uses_rf(D, MB) && D == 256, "register-fragment kernel: D = 256 verify");
  static_assert(VEC == 8 || VEC == 16, "load width");
  static_assert(MIN_BLOCKS * SMEM_BYTES <= 96 * 1024, "two CTAs per SM70 SM");
  static_assert(EPI_BYTES <= RED_OFF, "epilogue staging leaves the row state");
  static_assert(CPT % TPK == 0 && ACTIVE <= THREADS, "gather layout");
  static_assert(T_OFF % 16 == 0 && P_OFF % 16 == 0 && RED_OFF % 16 == 0 && META_OFF % 8 == 0, "aligned accesses");
};

// Most context splits the plan makes (plan.h).
__host__ __device__ constexpr int attn_max_splits() { return 512; }

// Warps that share one output row in the combine: a warp folds U = 16 splits per pass, so up
// to 16 splits take one warp per row (16 rows per CTA), up to 64 four (4 rows), more all 16.
__host__ __device__ constexpr int combine_warps_per_row(int splits) {
  return splits <= 16 ? 1 : splits <= 64 ? 4 : 16;
}

// Combine (split-K reduction): a CTA takes 64 columns (two adjacent ones per lane) of ROWS =
// WARPS / WPR output rows; the WPR warps of a row share its splits, U loads in flight each.
template <int D_, int WPR_>
struct CombineTraits {
  static constexpr int D = D_, WPR = WPR_, CW = 64, WARPS = 16, THREADS = 32 * WARPS, U = 16;
  static constexpr int ROWS = WARPS / WPR;
  // Two CTAs per SM (at most 64 registers a thread), as the one-kernel combine had on sm_70:
  // without the bound ptxas takes 68-69 there, and a V100 SM would hold one.
  static constexpr int MIN_BLOCKS = 2;
  // per-warp sums and maxima for the merge of a row's warps (none with one warp per row)
  static constexpr int SMEM_BYTES = WPR == 1 ? 0 : (WARPS * CW + 2 * WARPS) * 4;
  static_assert(D % CW == 0, "head dim");
  static_assert(WPR == 1 || WPR == 4 || WPR == 16, "warps per row: combine_warps_per_row");
};

// The combine of paged_attention_varlen's split requests (varlen.cuh): a unit of 8 tokens a
// CTA, one warp a row.
template <int D_>
struct CombineVarlenTraits {
  static constexpr int D = D_, WARPS = 8, THREADS = 32 * WARPS, SMEM_BYTES = 0, MIN_BLOCKS = 2;
  static_assert(D % 64 == 0, "head dim");
};

// paged_attention_varlen's tiles: 64 rows (MB 4) for every head dim, the rows position-major;
// its kernel takes kVarlenSmemExtra bytes of shared memory past its traits' SMEM_BYTES (the
// tile's request: varlen.h).
__host__ __device__ constexpr int varlen_row_blocks() { return 4; }
constexpr int kVarlenSmemExtra = 32;

// The prefill kernel of paged_attention_varlen (prefill.cuh): the requests of a step with more
// than kPrefillMinQ tokens. Query rows of its CTA: 64 at D 256 (Q 33 KB, the K/V tile 33 KB),
// 128 below.
__host__ __device__ constexpr int prefill_rows(int d) { return d == 256 ? 64 : 128; }

template <int D_, int VEC_>
struct PrefillTraits {
  static constexpr int D = D_, VEC = VEC_;
  static constexpr int ROWS = prefill_rows(D), N = 64, WARPS = 16, THREADS = 32 * WARPS, MIN_BLOCKS = 1;
  static constexpr bool V_OVER_K = D == 256;  // one tile buffer: Q, K and V do not fit 96 KB at D 256
  // QK^T: warp w = (rq, cq) = (w / 4, w % 4) takes rows [RQ rq, RQ rq + RQ) and keys [16 cq, 16 cq + 16).
  static constexpr int WCQ = 4, RQ = ROWS / 4, NRB = RQ / 16;
  // PV: warp w = (rp, cp) = (w / WCP, w % WCP) takes rows [32 rp, 32 rp + 32) and CP columns
  // (PfOps: which ones).
  static constexpr int RP = 32, WRP = ROWS / RP, WCP = WARPS / WRP, CP = D / WCP;
  // KV gather (kv_tile.h), as AttnTraits
  static constexpr int CPT = D / VEC;
  static constexpr int TPK = pow2_floor(THREADS / N < CPT ? THREADS / N : CPT);
  static constexpr int LPT = CPT / TPK, ACTIVE = N * TPK;
  // Leading dims (halves; floats for E): rows 16 bytes mod 128 apart, so the fragment loads of a
  // quad-pair's 4 rows (m8n8k4) and the gather's 16-byte stores hit distinct banks.
  static constexpr int QLD = D + 8, KLD = D + 8, PLD = N + 8, ELD = D + 4;
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + ROWS * QLD * 2;
  static constexpr int V_OFF = K_OFF + (V_OVER_K ? 0 : N * KLD * 2);
  static constexpr int P_OFF = V_OFF + N * KLD * 2;         // [ROWS][PLD] fp16
  static constexpr int RED_OFF = P_OFF + ROWS * PLD * 2;    // [ROWS][WCQ] fp32: maxima, then sums
  static constexpr int ALPHA_OFF = RED_OFF + ROWS * WCQ * 4;  // [ROWS] fp32: O's rescale, then m
  static constexpr int MOVED_OFF = ALPHA_OFF + ROWS * 4;    // [4] ints: a row of row group rq moved
  static constexpr int TOK_OFF = MOVED_OFF + 16;            // [N] "page valid" flags
  static constexpr int TILE_OFF = TOK_OFF + N * 4;          // the CTA's request (varlen_scan: 7 ints)
  static constexpr int META_OFF = TILE_OFF + 32;            // [3] i64: K and V bases, block table row
  static constexpr int LAST_OFF = META_OFF + 24;            // [ROWS] the last token a row sees (-1: padding)
  static constexpr int SMEM_BYTES = LAST_OFF + ROWS * 4;
  static constexpr int EPI_BYTES = ROWS * ELD * 4;          // fp32 O for the epilogue (aliases Q..P)
  // The online softmax's lazy rescale (as paged_attention_rf.cuh): m moves when a tile's maximum
  // passes it by more than this (log2 units), so P <= 2^8.
  static constexpr float RESCALE_LOG2 = 8.f;
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static_assert(VEC == 8 || VEC == 16, "load width");
  static_assert(RQ % 16 == 0 && ROWS % RP == 0 && WARPS % WRP == 0 && CP % 16 == 0, "warp tiles");
  static_assert(CPT % TPK == 0 && ACTIVE <= THREADS, "gather layout");
  static_assert(EPI_BYTES <= RED_OFF, "epilogue staging leaves the row state");
  static_assert(SMEM_BYTES <= 96 * 1024, "SM70 shared memory per block");
  static_assert(K_OFF % 16 == 0 && V_OFF % 16 == 0 && P_OFF % 16 == 0 && RED_OFF % 16 == 0, "aligned accesses");
};

constexpr int kPrefillMinQ = 16;

// store_kv: one thread quantizes 8 consecutive elements (or single elements on the slow path).
struct StoreKVTraits {
  static constexpr int THREADS = 256, SMEM_BYTES = 0;
};
// (the registry's form: a family's traits take its parameters, and store_kv has none)
template <int...>
using StoreKVTraitsOf = StoreKVTraits;

// The MMA atom check (mma_check.cuh, tests): one warp runs the atom of SHAPE (mma_atoms.h), 884
// m8n8k4, 8844 m8n8k4 with B row-major, 16816 m16n8k16.
struct MmaM8N8K4;
struct MmaM8N8K4RowRow;
struct MmaM16N8K16;
template <int SHAPE> struct MmaAtomOf;
template <> struct MmaAtomOf<884> { using type = MmaM8N8K4; };
template <> struct MmaAtomOf<8844> { using type = MmaM8N8K4RowRow; };
template <> struct MmaAtomOf<16816> { using type = MmaM16N8K16; };
template <int SHAPE>
struct MmaCheckTraits {
  using Atom = typename MmaAtomOf<SHAPE>::type;
  static constexpr int THREADS = 32, SMEM_BYTES = 0;
};

}  // namespace sm70attn
