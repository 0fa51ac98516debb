// The kernels of csrc/ (every family of the registration list, registry.h), run on the CPU and
// compared with an FP64 reference (store_kv: with the nearest E4M3 code). The headers beside this file stand in for CUDA: emu_runtime.h runs each thread as
// a fiber, scheduled in a random order between barriers (a missing barrier shows as a wrong or
// schedule-dependent result; mixed barriers as a deadlock), mma.h does WMMA per warp and checks
// that every lane passed the same inputs. Global buffers are exact-size copies, so
// AddressSanitizer catches out-of-bounds reads and writes. The kernels themselves compile in
// kernel_shard.cpp. tests/test_emulated_kernels.py builds it (the shards in parallel) and runs
// it; by hand, from the repository root:
//   g++ -std=c++17 -Og -fsanitize=address -Itests/emu -Icsrc tests/emu/kernels.cpp tests/emu/kernel_shard.cpp -o /tmp/k
//   /tmp/k [case]        (no case: all of them, a few minutes)
#include "emu_launch.h"
#include "sm70attn/plan.h"
#include "sm70attn/store_kv.cuh"
#include "emu_atoms.h"
#include "sm70attn/mma_check.cuh"
#include "sm70attn/prefill.cuh"
namespace sm70attn { alignas(128) unsigned char smem[100 * 1024]; }

using namespace sm70attn;

static bool g_ran[kFamilies];
void emu_ran(Family f) { g_ran[f] = true; }

static double e4m3_value(unsigned char b) {  // exact value; NaN code as the kernel sees it (480)
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  double v = e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  return s ? -v : v;
}

struct Problem {
  int B, H_q, H_kv, Q, D, page_size, P, max_pages;
  std::vector<int> seq_lens, block_table;
  std::vector<unsigned short> q;  // stored as [B, Q, H_q, D] (SDPA-transposed strides)
  std::vector<unsigned char> kv;  // interleaved or separate caches (see layout)
  i64 k_off, v_off, s_page, s_tok, s_head;  // byte offsets/strides of K and V inside kv
  std::vector<float> ks, vs;
  float scale;
  float* ks_ptr() { return ks.data(); }
};

static std::mt19937 grng(123);
static float frand() { return std::uniform_real_distribution<float>(-1, 1)(grng); }

// layout 0: separate dense caches; 1: K/V interleaved per token with an 8-byte pad (8-aligned only)
Problem make(int B, int H_q, int H_kv, int Q, int D, int page_size, int P, int max_pages, int layout, bool per_head) {
  Problem p{B, H_q, H_kv, Q, D, page_size, P, max_pages};
  p.seq_lens.resize(B);
  p.block_table.resize((size_t)B * max_pages);
  for (auto& x : p.block_table) x = (int)(grng() % P);
  p.q.resize((size_t)B * Q * H_q * D);
  for (auto& x : p.q) x = __half_as_ushort(__float2half_rn(frand() * 2));
  if (layout == 0) {
    p.s_head = D, p.s_tok = (i64)H_kv * D, p.s_page = (i64)page_size * H_kv * D;
    p.kv.resize(2 * (size_t)P * p.s_page);
    p.k_off = 0, p.v_off = (i64)P * p.s_page;
  } else {
    p.s_head = D + 8, p.s_tok = 2 * (i64)H_kv * (D + 8) + 8, p.s_page = (i64)page_size * p.s_tok + 8;
    p.kv.resize((size_t)P * p.s_page + 8);
    p.k_off = 8, p.v_off = 8 + (i64)H_kv * (D + 8);
  }
  for (auto& x : p.kv) {  // |value| < 4: softmax not one-hot, so masking errors show
    const unsigned r = grng();
    x = (unsigned char)((r & 0x80) | ((r >> 8) % 9) << 3 | ((r >> 16) & 7));
  }
  int nh = per_head ? H_kv : 1;
  for (int i = 0; i < nh; ++i) p.ks.push_back(0.5f + (frand() + 1) * 0.5f), p.vs.push_back(0.5f + (frand() + 1));
  p.scale = 1.0f / std::sqrt((float)D);
  return p;
}

const unsigned short& qat(const Problem& p, int b, int h, int r, int d) {
  return p.q[(((size_t)b * p.Q + r) * p.H_q + h) * p.D + d];
}

std::vector<double> reference(const Problem& p) {
  std::vector<double> out((size_t)p.B * p.H_q * p.Q * p.D, 0.0);
  const int G = p.H_q / p.H_kv, cap = p.max_pages * p.page_size;
  for (int b = 0; b < p.B; ++b) {
    const int len = std::min(std::max(p.seq_lens[b], 0), cap);
    for (int h = 0; h < p.H_q; ++h) {
      const int kvh = h / G;
      const double ks = p.ks[p.ks.size() == 1 ? 0 : kvh], vs = p.vs[p.vs.size() == 1 ? 0 : kvh];
      for (int r = 0; r < p.Q; ++r) {
        std::vector<double> sc; std::vector<i64> base;
        for (int t = 0; t <= len - p.Q + r; ++t) {
          const int page = p.block_table[(size_t)b * p.max_pages + t / p.page_size];
          if (page < 0 || page >= p.P) continue;
          const i64 off = page * p.s_page + (t % p.page_size) * p.s_tok + kvh * p.s_head;
          double s = 0;
          for (int d = 0; d < p.D; ++d)
            s += (double)__half2float(__ushort_as_half(qat(p, b, h, r, d))) * e4m3_value(p.kv[p.k_off + off + d]) * ks;
          sc.push_back(s * p.scale);
          base.push_back(off);
        }
        if (sc.empty()) continue;
        const double m = *std::max_element(sc.begin(), sc.end());
        double l = 0;
        for (auto& s : sc) l += (s = std::exp(s - m));
        double* o = &out[(((size_t)b * p.H_q + h) * p.Q + r) * p.D];
        for (size_t i = 0; i < sc.size(); ++i)
          for (int d = 0; d < p.D; ++d) o[d] += sc[i] / l * e4m3_value(p.kv[p.v_off + base[i] + d]) * vs;
      }
    }
  }
  return out;
}

static bool g_q_misaligned = false;
static int g_ctas_per_sm = 2;
static int g_combine_as = 0;  // > 0: launch the combine kernel picked for this many splits
static int g_kind = -1;       // >= 0: the kernel kind (AttnKind) where the register-fragment one applies
                              // (-1: the SM70 launcher's default, attn_default_kind)
std::vector<unsigned short> run(Problem& p, int num_sms, int* splits_out = nullptr, int force_splits = 0) {
  const i64 cap = (i64)p.max_pages * p.page_size;
  AttnPlan plan = plan_paged_attention(p.B, p.H_q, p.H_kv, p.Q, p.D, cap, num_sms, g_ctas_per_sm);
  if (force_splits) {
    plan.num_splits = force_splits;
    plan.workspace_floats = split_workspace_floats((i64)p.B * p.H_q * p.Q, force_splits, p.D);
  }
  if (splits_out) *splits_out = plan.num_splits;
  // exact-size copies so ASan sees any out-of-bounds access
  std::vector<unsigned short>* qv = new std::vector<unsigned short>(p.q);
  if (g_q_misaligned) qv->insert(qv->begin(), 0x7E00);
  std::vector<unsigned char>* kv = new std::vector<unsigned char>(p.kv);
  std::vector<int>* bt = new std::vector<int>(p.block_table), *sl = new std::vector<int>(p.seq_lens);
  std::vector<float>* ks = new std::vector<float>(p.ks), *vs = new std::vector<float>(p.vs);
  std::vector<unsigned short> out((size_t)p.B * p.H_q * p.Q * p.D, 0x7E00);  // poisoned (NaN)
  std::vector<float> ws(plan.workspace_floats, std::nanf(""));
  PagedAttnParams a{};
  a.q = reinterpret_cast<const __half*>(qv->data() + g_q_misaligned);
  a.q_stride_b = (i64)p.Q * p.H_q * p.D, a.q_stride_h = p.D, a.q_stride_r = (i64)p.H_q * p.D;
  a.k = kv->data() + p.k_off, a.v = kv->data() + p.v_off;
  a.k_stride_page = a.v_stride_page = p.s_page, a.k_stride_tok = a.v_stride_tok = p.s_tok;
  a.k_stride_head = a.v_stride_head = p.s_head;
  a.block_table = bt->data(), a.bt_stride_b = p.max_pages, a.seq_lens = sl->data(), a.seq_lens_stride = 1;
  a.k_scale = ks->data(), a.v_scale = vs->data();
  a.k_scale_stride = p.ks.size() == 1 ? 0 : 1, a.v_scale_stride = p.vs.size() == 1 ? 0 : 1;
  a.out = reinterpret_cast<__half*>(out.data());
  a.B = p.B, a.H_q = p.H_q, a.H_kv = p.H_kv, a.G = p.H_q / p.H_kv, a.Q = p.Q, a.D = p.D;
  a.page_size = p.page_size, a.max_pages = p.max_pages, a.num_pages = p.P, a.rows = a.G * p.Q;
  a.row_groups = plan.row_groups, a.num_splits = plan.num_splits;
  a.scale_log2 = (float)(p.scale * 1.4426950408889634);
  a.q_vec16 = !g_q_misaligned;
  set_workspace(a, plan.workspace_floats ? ws.data() : nullptr);
  set_divisors(a);
  const int vec = (p.k_off % 16 == 0 && p.v_off % 16 == 0 && p.s_page % 16 == 0 && p.s_tok % 16 == 0 && p.s_head % 16 == 0) ? 16 : 8;
  const dim3 grid(p.B * p.H_kv * plan.row_groups, plan.num_splits);
  const int kind = g_kind >= 0 && attn_uses_rf(p.D, plan.mb) ? g_kind : attn_default_kind(p.D, plan.mb, 70, cap);
  bool found = kind == ATTN_WMMA ? attn_switch(p.D, plan.mb, vec, [&](auto kt) { launch_attn<decltype(kt)>(grid, a); })
                                 : attn_rf_switch(p.D, plan.mb, vec, [&](auto kt) {
                                     if (kind == ATTN_RF_M8N8K4) launch_attn_rf<decltype(kt), MmaM8N8K4>(grid, a);
                                     else launch_attn_rf<decltype(kt), MmaM16N8K16>(grid, a);
                                   });
  if (!found) { fprintf(stderr, "no kernel for D%d MB%d VEC%d\n", p.D, plan.mb, vec); abort(); }
  if (plan.num_splits > 1)
    combine_switch(p.D, g_combine_as ? g_combine_as : plan.num_splits, [&](auto ct) {
      using CT = decltype(ct);
      launch_combine<CT>(dim3((unsigned)(((i64)p.B * p.H_q * p.Q + CT::ROWS - 1) / CT::ROWS), CT::D / CT::CW), a);
    });
  delete qv; delete kv; delete bt; delete sl; delete ks; delete vs;
  return out;
}

static int failures = 0;
void check(const char* name, Problem& p, int num_sms, int force_splits = 0) {
  int splits;
  auto out = run(p, num_sms, &splits, force_splits);
  auto ref = reference(p);
  // NaN where the reference is NaN (NaN inputs), nowhere else
  double max_err = 0, max_ref = 0, worst = 0; bool nan = false;
  for (size_t i = 0; i < ref.size(); ++i) if (!std::isnan(ref[i])) max_ref = std::max(max_ref, std::fabs(ref[i]));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = __half2float(__ushort_as_half(out[i]));
    if (std::isnan(ref[i])) { nan |= !std::isnan(o); continue; }
    if (std::isnan(o)) nan = true;
    max_err = std::max(max_err, std::fabs(o - ref[i]));
    // fp16 output rounding (2^-11 relative) + fp16 P (2^-11 of the row's value scale)
    worst = std::max(worst, std::fabs(o - ref[i]) / (std::fabs(ref[i]) * 0x1p-10 + max_ref * 0x1p-10));
  }
  // zero rows must be exactly zero
  bool zero_ok = true;
  for (size_t i = 0; i < ref.size(); ++i) if (ref[i] == 0.0 && out[i] != 0 && out[i] != 0x8000) zero_ok = false;
  const bool ok = !nan && zero_ok && worst <= 1.0;
  failures += !ok;
  printf("%-34s B%d Hq%d Hkv%d Q%d D%d pg%d P%d mp%d splits %3d  max|ref| %.3f  max err %.2e (%.2f of tol) %s%s%s\n", name, p.B, p.H_q,
         p.H_kv, p.Q, p.D, p.page_size, p.P, p.max_pages, splits, max_ref, max_err, worst, nan ? "NaN " : "",
         zero_ok ? "" : "NONZERO-EMPTY ", ok ? "ok" : "FAIL");
  fflush(stdout);
}

// paged_attention_varlen: p's caches and table (its B requests; its q unused), packed query rows
// [T, H_q, D], query_start_loc qsl [B + 1] as given (any values: the reference reads them as
// varlen.h says the kernel does). split_tokens > 0: split requests of up to split_q tokens every
// split_tokens tokens (tiny problems reach the split path).
struct Varlen {
  std::vector<int> qsl;
  int T;
  std::vector<unsigned short> q;
};

Varlen make_varlen(const Problem& p, std::vector<int> qsl, int T) {
  Varlen v{qsl, T, std::vector<unsigned short>((size_t)T * p.H_q * p.D)};
  for (auto& x : v.q) x = __half_as_ushort(__float2half_rn(frand() * 2));
  return v;
}

// Request b's tokens [start, end) as the kernel reads query_start_loc (varlen.h).
std::vector<std::pair<int, int>> varlen_requests(const Problem& p, const Varlen& v) {
  std::vector<std::pair<int, int>> r;
  int end = 0;
  for (int b = 0; b < p.B; ++b) {
    const int start = end;
    end = std::max(end, std::min(std::max(v.qsl[b + 1], 0), v.T));
    r.push_back({start, end});
  }
  return r;
}

std::vector<double> varlen_reference(const Problem& p, const Varlen& v) {
  std::vector<double> out((size_t)v.T * p.H_q * p.D, 0.0);
  const int G = p.H_q / p.H_kv, cap = p.max_pages * p.page_size;
  const auto req = varlen_requests(p, v);
  for (int b = 0; b < p.B; ++b) {
    const int len = std::min(std::max(p.seq_lens[b], 0), cap), q = req[b].second - req[b].first;
    for (int i = 0; i < q; ++i)
      for (int h = 0; h < p.H_q; ++h) {
        const int kvh = h / G, tok = req[b].first + i;
        const double ks = p.ks[p.ks.size() == 1 ? 0 : kvh], vs = p.vs[p.vs.size() == 1 ? 0 : kvh];
        const unsigned short* qr = &v.q[((size_t)tok * p.H_q + h) * p.D];
        std::vector<double> sc;
        std::vector<i64> base;
        for (int t = 0; t <= len - q + i; ++t) {
          const int page = p.block_table[(size_t)b * p.max_pages + t / p.page_size];
          if (page < 0 || page >= p.P) continue;
          const i64 off = page * p.s_page + (t % p.page_size) * p.s_tok + kvh * p.s_head;
          double s = 0;
          for (int d = 0; d < p.D; ++d) s += (double)__half2float(__ushort_as_half(qr[d])) * e4m3_value(p.kv[p.k_off + off + d]) * ks;
          sc.push_back(s * p.scale), base.push_back(off);
        }
        if (sc.empty()) continue;
        const double m = *std::max_element(sc.begin(), sc.end());
        double l = 0;
        for (auto& x : sc) l += (x = std::exp(x - m));
        double* o = &out[((size_t)tok * p.H_q + h) * p.D];
        for (size_t k = 0; k < sc.size(); ++k)
          for (int d = 0; d < p.D; ++d) o[d] += sc[k] / l * e4m3_value(p.kv[p.v_off + base[k] + d]) * vs;
      }
  }
  return out;
}

// Which kernel run_varlen launches: varlen.cuh's tile loop, or the prefill kernel (on each atom)
// for every request with tokens.
enum VarlenKernelSel { VL_TILES, VL_PREFILL_M8N8K4, VL_PREFILL_M16N8K16 };

template <class At>
bool launch_prefill_of(int d, int vec, dim3 grid, const PagedAttnParams& a) {
#define PF_CASE(D_, VEC_) \
  if (d == D_ && vec == VEC_) return launch_prefill<PrefillTraits<D_, VEC_>, At>(grid, a), true;
  SM70ATTN_PREFILL_KERNELS(PF_CASE)
#undef PF_CASE
  return false;
}

std::vector<unsigned short> run_varlen(Problem& p, Varlen& v, int num_sms, int split_tokens, int* units_used,
                                       VarlenKernelSel sel = VL_TILES) {
  const i64 cap = (i64)p.max_pages * p.page_size;
  VarlenPlan plan = plan_paged_attention_varlen(v.T, p.B, p.H_q, p.H_kv, p.D, cap, num_sms, 1);
  if (split_tokens > 0) {  // the rule with small numbers (workspace re-sized as the plan sizes it)
    plan.split_tokens = split_tokens, plan.split_cap = 4;
    const i64 unit_floats = 8ll * p.H_q * plan.split_cap * (p.D / 2 + 2);
    plan.units = (int)std::min<i64>(6, (v.T + 7) / 8 + p.B);
    plan.workspace_floats = plan.units * unit_floats + 4ll * plan.units;
  }
  auto* qv = new std::vector<unsigned short>(v.q);
  auto* kv = new std::vector<unsigned char>(p.kv);
  auto *bt = new std::vector<int>(p.block_table), *sl = new std::vector<int>(p.seq_lens), *qs = new std::vector<int>(v.qsl);
  auto *ks = new std::vector<float>(p.ks), *vs = new std::vector<float>(p.vs);
  std::vector<unsigned short> out((size_t)v.T * p.H_q * p.D, 0x7E00);  // poisoned (NaN)
  std::vector<float> ws(plan.workspace_floats, std::nanf(""));
  PagedAttnParams a{};
  a.q = reinterpret_cast<const __half*>(qv->data());
  a.q_stride_b = (i64)p.H_q * p.D, a.q_stride_h = p.D;
  a.k = kv->data() + p.k_off, a.v = kv->data() + p.v_off;
  a.k_stride_page = a.v_stride_page = p.s_page, a.k_stride_tok = a.v_stride_tok = p.s_tok;
  a.k_stride_head = a.v_stride_head = p.s_head;
  a.block_table = bt->data(), a.bt_stride_b = p.max_pages, a.seq_lens = sl->data(), a.seq_lens_stride = 1;
  a.qsl = qs->data();
  a.k_scale = ks->data(), a.v_scale = vs->data();
  a.k_scale_stride = p.ks.size() == 1 ? 0 : 1, a.v_scale_stride = p.vs.size() == 1 ? 0 : 1;
  a.out = reinterpret_cast<__half*>(out.data());
  a.B = p.B, a.H_q = p.H_q, a.H_kv = p.H_kv, a.G = p.H_q / p.H_kv, a.Q = 1, a.D = p.D, a.T = v.T;
  a.page_size = p.page_size, a.max_pages = p.max_pages, a.num_pages = p.P, a.rows = a.G;
  a.row_groups = 1, a.num_splits = 1;
  a.split_cap = plan.split_cap, a.split_tokens = plan.split_tokens, a.split_q = plan.split_q;
  a.split_target = plan.split_target, a.units = plan.units;
  a.scale_log2 = (float)(p.scale * 1.4426950408889634);
  a.q_vec16 = 1;
  set_varlen_workspace(a, plan.workspace_floats ? ws.data() : nullptr);
  for (int i = 0; i < 4 * plan.units; ++i) a.unit_head[i] = 0;
  set_divisors(a);
  const int vec = (p.k_off % 16 == 0 && p.v_off % 16 == 0 && p.s_page % 16 == 0 && p.s_tok % 16 == 0 && p.s_head % 16 == 0) ? 16 : 8;
  a.pf_min_q = sel == VL_TILES ? 0x7fffffff : 0, a.pf_split_target = plan.split_target;
  if (sel == VL_TILES) {
    if (!varlen_switch(p.D, varlen_row_blocks(), vec, [&](auto kt) {
          launch_varlen<decltype(kt)>(dim3((unsigned)(plan.tiles * p.H_kv), plan.split_cap), a);
        })) abort();
  } else {
    const i64 rows = prefill_rows(p.D), tiles = ((i64)v.T * a.G + rows - 1) / rows + p.B + 1;
    const dim3 grid((unsigned)(tiles * p.H_kv), plan.split_cap);
    if (!(sel == VL_PREFILL_M8N8K4 ? launch_prefill_of<MmaM8N8K4>(p.D, vec, grid, a)
                                   : launch_prefill_of<MmaM16N8K16>(p.D, vec, grid, a))) abort();
  }
  int used = 0;
  for (int u = 0; u < plan.units; ++u) used += a.unit_head[4 * u + 1] > 0;
  if (units_used) *units_used = used;
  if (plan.units > 0) combine_varlen_switch(p.D, [&](auto ct) { launch_combine_varlen<decltype(ct)>(dim3(plan.units), a); });
  delete qv; delete kv; delete bt; delete sl; delete qs; delete ks; delete vs;
  return out;
}

void check_varlen(const char* name, Problem& p, Varlen& v, int num_sms, int split_tokens = 0, int want_units = -1,
                  VarlenKernelSel sel = VL_TILES) {
  int units = 0;
  auto out = run_varlen(p, v, num_sms, split_tokens, &units, sel);
  auto ref = varlen_reference(p, v);
  double max_err = 0, max_ref = 0, worst = 0;
  bool nan = false, zero_ok = true;
  for (double r : ref) max_ref = std::max(max_ref, std::fabs(r));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = __half2float(__ushort_as_half(out[i]));
    if (std::isnan(o)) nan = true;
    max_err = std::max(max_err, std::fabs(o - ref[i]));
    worst = std::max(worst, std::fabs(o - ref[i]) / (std::fabs(ref[i]) * 0x1p-10 + max_ref * 0x1p-10));
    if (ref[i] == 0.0 && out[i] != 0 && out[i] != 0x8000) zero_ok = false;
  }
  const bool units_ok = want_units < 0 || units == want_units;
  const bool ok = !nan && zero_ok && worst <= 1.0 && units_ok;
  failures += !ok;
  printf("%-34s B%d T%d Hq%d Hkv%d D%d pg%d units %d  max|ref| %.3f  max err %.2e (%.2f of tol) %s%s%s%s\n", name, p.B,
         v.T, p.H_q, p.H_kv, p.D, p.page_size, units, max_ref, max_err, worst, nan ? "NaN " : "",
         zero_ok ? "" : "NONZERO-EMPTY ", units_ok ? "" : "UNITS ", ok ? "ok" : "FAIL");
  fflush(stdout);
}

int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : "";
  auto want = [&](const char* n) { return strstr(n, only) != nullptr; };
  if (want("atoms")) {  // mma_check_kernel through the emulated atoms against a double product
    auto atom = [&](auto at, const char* name) {
      using At = decltype(at);
      const int G = At::GROUPS, M = At::M, N = At::N, K = At::K;
      std::vector<__half> A(G * M * K), B(G * K * N);
      std::vector<float> C(G * M * N), D(G * M * N, std::nanf(""));
      for (auto& x : A) x = __float2half_rn(frand());
      for (auto& x : B) x = __float2half_rn(frand());
      for (auto& x : C) x = frand();
      emu_ran(MMA_CHECK);
      emu::run_block(dim3(0), dim3(1), 32, [&] { mma_check_kernel<At>(A.data(), B.data(), C.data(), D.data()); });
      double worst = 0;
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < M; ++r)
          for (int c = 0; c < N; ++c) {
            double want = C[(g * M + r) * N + c];
            for (int k = 0; k < K; ++k)
              want += (double)__half2float(A[(g * M + r) * K + k]) * __half2float(B[(g * K + k) * N + c]);
            const double e = std::fabs(D[(g * M + r) * N + c] - want);
            worst = std::isnan(e) ? INFINITY : std::max(worst, e);
          }
      const bool ok = worst <= 1e-5;
      failures += !ok;
      printf("atoms %-12s %d group(s) of %dx%dx%d  max err %.2e %s\n", name, G, M, N, K, worst, ok ? "ok" : "FAIL");
    };
    atom(MmaM8N8K4{}, "m8n8k4");
    atom(MmaM8N8K4RowRow{}, "m8n8k4 row.row");
    atom(MmaM16N8K16{}, "m16n8k16");
  }
  if (want("storekv")) {  // store_kv_kernel on both paths against the nearest code found by search
    // the e4m3 code of q: the nearest of the finite codes, ties to the even code, beyond 448 the
    // largest; NaN: 0x7F with the input's sign
    auto nearest = [](double q, bool neg) -> unsigned char {
      if (std::isnan(q)) return (unsigned char)(0x7F | (neg ? 0x80 : 0));
      const double a = std::fabs(q);
      int best = 0;
      for (int c = 1; c <= 0x7E; ++c) {
        const double d = std::fabs(e4m3_value((unsigned char)c) - a), e = std::fabs(e4m3_value((unsigned char)best) - a);
        if (d < e || (d == e && (c & 1) == 0)) best = c;
      }
      return (unsigned char)(best | (std::signbit(q) ? 0x80 : 0));
    };
    for (const int vec8 : {1, 0}) {
      const int T = 7, H = 2, D = vec8 ? 64 : 20, page = 4, P = 5;
      std::vector<long long> slots = {0, 5, -1, 19, 3, 20, 7};  // -1 and 20 (= P * page) skipped
      std::vector<unsigned short> key((size_t)T * H * D), value(key.size());
      int i = 0;
      for (auto* x : {&key, &value})
        for (auto& h : *x) {
          const float f = ++i % 97 == 0 ? NAN : i % 89 == 0 ? 3000.f : i % 13 == 0 ? frand() * 0x1p-12f : frand() * 600;
          h = __half_as_ushort(__float2half_rn(f));
        }
      std::vector<float> ks = {0.75f, 1.25f}, vs = {1.5f, 0.5f};
      std::vector<unsigned char> kc((size_t)P * page * H * D, 0x55), vc(kc.size(), 0x55);
      StoreKVParams a{};
      a.key = reinterpret_cast<const __half*>(key.data()), a.value = reinterpret_cast<const __half*>(value.data());
      a.key_stride_t = a.value_stride_t = (i64)H * D, a.key_stride_h = a.value_stride_h = D;
      a.k_cache = kc.data(), a.v_cache = vc.data();
      a.kc_stride_page = a.vc_stride_page = (i64)page * H * D, a.kc_stride_tok = a.vc_stride_tok = (i64)H * D;
      a.kc_stride_head = a.vc_stride_head = D;
      a.slot_mapping = slots.data(), a.slot_stride = 1;
      a.k_scale = ks.data(), a.v_scale = vs.data(), a.k_scale_stride = a.v_scale_stride = 1;
      a.T = T, a.H_kv = H, a.D = D, a.page_size = page, a.num_pages = P, a.vec8 = vec8;
      const i64 items = (i64)T * H * (vec8 ? D / 8 : D);
      emu_ran(STORE_KV);
      for (i64 blk = 0; blk * StoreKVTraits::THREADS < items; ++blk)
        emu::run_block(dim3((unsigned)blk), dim3((unsigned)((items + 255) / 256)), StoreKVTraits::THREADS,
                       [&] { store_kv_kernel(a); });
      int bad = 0;
      std::vector<unsigned char> wk(kc.size(), 0x55), wv(vc.size(), 0x55);
      for (int t = 0; t < T; ++t) {
        if (slots[t] < 0 || slots[t] >= P * page) continue;
        for (int h = 0; h < H; ++h)
          for (int d = 0; d < D; ++d) {
            const size_t src = ((size_t)t * H + h) * D + d, dst = ((size_t)slots[t] * H + h) * D + d;
            const unsigned short k = key[src], v = value[src];
            wk[dst] = nearest((double)__half2float(__ushort_as_half(k)) / ks[h], k >> 15);
            wv[dst] = nearest((double)__half2float(__ushort_as_half(v)) / vs[h], v >> 15);
          }
      }
      for (size_t j = 0; j < kc.size(); ++j) bad += (kc[j] != wk[j]) + (vc[j] != wv[j]);
      failures += bad != 0;
      printf("storekv %s D%d: %d of %zu cache bytes differ from the nearest codes %s\n", vec8 ? "8-element" : "element",
             D, bad, 2 * kc.size(), bad ? "FAIL" : "ok");
    }
  }
  if (want("plan")) {  // host plan over a grid of shapes: bounds, whole waves, B-independence
    int bad = 0, n = 0;
    for (int D : {64, 128, 256})
      for (int G : {1, 4, 6, 8})
        for (int Q : {1, 8, 16})
          for (int H_kv : {1, 2, 4, 8})
            for (i64 cap : {16LL, 1000LL, 8192LL, 32768LL, 131072LL, 262144LL})
              for (int sms : {1, 7, 80, 132, 264})
                for (int cps : {1, 2, 3, 4}) {
                  const AttnPlan a = plan_paged_attention(1, G * H_kv, H_kv, Q, D, cap, sms, cps);
                  const AttnPlan b = plan_paged_attention(16, G * H_kv, H_kv, Q, D, cap, sms, cps);
                  const i64 per_request = (i64)H_kv * a.row_groups;
                  const i64 wave = std::max<i64>(1, std::max(cps, 1) * (i64)sms / per_request);
                  const i64 rows = std::min(G * Q, 16 * a.mb);
                  const i64 min_split = std::max<i64>(4 * attn_tile_tokens(D, a.mb), 16 * rows);
                  const bool ok = a.mb == b.mb && a.row_groups == b.row_groups && a.num_splits == b.num_splits &&
                                  a.num_splits >= 1 && a.num_splits <= attn_max_splits() &&
                                  (a.num_splits == 1 || a.num_splits <= cap / min_split) &&
                                  (a.num_splits <= wave || a.num_splits % wave == 0) &&
                                  a.mb <= attn_max_row_blocks(D) && 16 * a.mb * a.row_groups >= G * Q &&
                                  (a.num_splits > 1) == (b.workspace_floats > 0);
                  bad += !ok, ++n;
                }
    printf("plan: %d shapes, %d bad %s\n", n, bad, bad ? "FAIL" : "ok");
    failures += bad != 0;
  }
  if (want("varlen")) {  // paged_attention_varlen: a decode, a verify, an empty request, a whole
    // prompt, a chunk over a past, padding tokens; each head dim, G 1 and 6, unsplit and split
    for (int D : {64, 128, 256})
      for (int G : {1, 6}) {
        const int H_kv = D == 256 ? 1 : 2;
        Problem p = make(5, G * H_kv, H_kv, 1, D, 16, 60, 14, 0, true);
        p.seq_lens = {40, 105, 9, 23, 200};           // request lengths (past + new)
        Varlen v = make_varlen(p, {0, 1, 9, 9, 32, 44}, 47);  // 1, 8, 0, 23 (whole), 12 over 188; 3 pad
        char name[64];
        snprintf(name, sizeof name, "varlen D%d G%d", D, G);
        check_varlen(name, p, v, 4);
        snprintf(name, sizeof name, "varlen D%d G%d split", D, G);
        check_varlen(name, p, v, 4, 32, -1);
      }
    for (int split : {0, 32}) {  // a request alone and in the batch: the same bits
      Problem p = make(5, 12, 2, 1, 128, 16, 60, 14, 0, true);
      p.seq_lens = {40, 105, 9, 23, 200};
      Varlen v = make_varlen(p, {0, 1, 9, 9, 32, 44}, 47);
      Problem one = p;
      one.B = 1, one.seq_lens = {200};
      one.block_table.assign(p.block_table.begin() + 4 * p.max_pages, p.block_table.begin() + 5 * p.max_pages);
      Varlen v1{{0, 12}, 12, std::vector<unsigned short>(v.q.begin() + 32 * 12 * 128, v.q.begin() + 44 * 12 * 128)};
      const auto all = run_varlen(p, v, 4, split, nullptr), alone = run_varlen(one, v1, 4, split, nullptr);
      const bool same = std::equal(alone.begin(), alone.end(), all.begin() + 32 * 12 * 128);
      failures += !same;
      printf("varlen alone == batched (split %d): %s\n", split, same ? "ok" : "FAIL");
    }
    {  // the unit budget: 6 units; requests of 1, 8, 9 and 20 tokens claim 1, 1, 2, 3: the last runs unsplit
      Problem p = make(4, 12, 2, 1, 128, 16, 80, 20, 0, false);
      p.seq_lens = {300, 280, 260, 250};
      Varlen v = make_varlen(p, {0, 1, 9, 18, 38}, 38);
      check_varlen("varlen budget", p, v, 4, 32, 4);
    }
    {  // bad metadata: qsl not starting at 0, decreasing, past T; lengths < q, > capacity, < 0; bad pages
      Problem p = make(5, 8, 2, 1, 64, 7, 40, 9, 1, true);  // interleaved 8-byte aligned K/V, page 7
      p.seq_lens = {3, 70, -5, 1000, 30};
      p.block_table[1 * 9 + 2] = -7, p.block_table[4 * 9 + 1] = 99;
      Varlen v = make_varlen(p, {5, 9, 4, 20, 12, 60}, 30);
      check_varlen("varlen bad metadata", p, v, 4);
      check_varlen("varlen bad metadata split", p, v, 4, 16);
    }
    {  // a long prompt: several tiles a KV head, tiles straddling pages and tokens (G 6: 64 % 6 != 0)
      Problem p = make(1, 12, 2, 1, 64, 37, 12, 12, 0, true);
      p.seq_lens = {420};
      Varlen v = make_varlen(p, {0, 150}, 150);
      check_varlen("varlen long chunk G6", p, v, 4);
    }
  }
  if (want("prefill")) {  // the prefill kernel on each atom: varlen's problems, and longer ones whose
    // tiles are whole (the unmasked main loop) before the diagonal
    const char* atom_names[] = {"", "m8n8k4", "m16n8k16"};
    for (VarlenKernelSel sel : {VL_PREFILL_M8N8K4, VL_PREFILL_M16N8K16}) {
      for (int D : {64, 128, 256})
        for (int G : {1, 6}) {
          const int H_kv = D == 256 ? 1 : 2;
          Problem p = make(5, G * H_kv, H_kv, 1, D, 16, 60, 14, 0, true);
          p.seq_lens = {40, 105, 9, 23, 200};
          Varlen v = make_varlen(p, {0, 1, 9, 9, 32, 44}, 47);  // 1, 8, 0, 23 (whole), 12 over 188; 3 pad
          char name[80];
          snprintf(name, sizeof name, "prefill %s D%d G%d", atom_names[sel], D, G);
          check_varlen(name, p, v, 4, 0, -1, sel);
          snprintf(name, sizeof name, "prefill %s D%d G%d split", atom_names[sel], D, G);
          check_varlen(name, p, v, 4, 32, -1, sel);
        }
      for (int D : {128, 256}) {  // chunks over pasts of several whole tiles, G 4 and 6, page 37 (tiles straddle pages)
        const int G = D == 256 ? 6 : 4;
        Problem p = make(2, 2 * G, 2, 1, D, 37, 30, 12, 0, true);
        p.seq_lens = {400, 250};
        Varlen v = make_varlen(p, {0, 70, 100}, 103);  // 70 over 330, 30 over 220; 3 pad
        char name[80];
        snprintf(name, sizeof name, "prefill %s D%d G%d long", atom_names[sel], D, G);
        check_varlen(name, p, v, 4, 0, -1, sel);
      }
      {  // bad metadata, interleaved 8-byte aligned K/V (VEC 8), page 7
        Problem p = make(5, 8, 2, 1, 64, 7, 40, 9, 1, true);
        p.seq_lens = {3, 70, -5, 1000, 30};
        p.block_table[1 * 9 + 2] = -7, p.block_table[4 * 9 + 1] = 99;
        Varlen v = make_varlen(p, {5, 9, 4, 20, 12, 60}, 30);
        char name[80];
        snprintf(name, sizeof name, "prefill %s bad metadata", atom_names[sel]);
        check_varlen(name, p, v, 4, 0, -1, sel);
        snprintf(name, sizeof name, "prefill %s bad metadata split", atom_names[sel]);
        check_varlen(name, p, v, 4, 16, -1, sel);
      }
    }
  }
  if (want("decode")) {  // D128 G4 Q1, random lengths incl. 0 and > capacity
    Problem p = make(3, 8, 2, 1, 128, 16, 40, 20, 0, true);
    p.seq_lens = {0, 157, 1000};
    check("decode", p, 8);
  }
  if (want("verify")) {  // Q8 G6 D256: two row groups? no: 48 rows, MB3
    Problem p = make(2, 6, 1, 8, 256, 37, 30, 9, 0, false);
    p.seq_lens = {300, 5};
    check("verify D256 G6 Q8", p, 16);
  }
  if (want("combine")) {  // each combine kernel (1, 4, 16 warps per row), rows not a multiple of its 16 / 4 / 1
    Problem p = make(3, 5, 1, 3, 64, 7, 200, 60, 0, true);  // 45 output rows
    p.seq_lens = {400, 3, 170};
    for (int sp : {5, 16, 17, 40, 64, 65, 130}) {
      char name[64];
      snprintf(name, sizeof name, "combine WPR%d s%d", combine_warps_per_row(sp), sp);
      check(name, p, 4, sp);
    }
    // up to 16 splits, one warp per row adds the same terms in the same order as 16 warps per row
    bool same = true;
    for (int sp : {2, 9, 16}) {
      const auto one = run(p, 4, nullptr, sp);
      g_combine_as = attn_max_splits();
      same &= one == run(p, 4, nullptr, sp);
      g_combine_as = 0;
    }
    failures += !same;
    printf("determinism: combine WPR1 vs WPR16 %s\n", same ? "same" : "DIFFER");
  }
  if (want("nanrow")) {  // NaN in one query row: that row NaN with 1 split and through each combine kernel, others right
    Problem p = make(2, 4, 2, 3, 64, 16, 80, 40, 0, true);
    p.seq_lens = {600, 200};
    const_cast<unsigned short&>(qat(p, 0, 1, 2, 5)) = 0x7E00;  // request 0, query head 1, row 2
    for (int sp : {1, 5, 30, 100}) {
      char name[64];
      snprintf(name, sizeof name, "nanrow WPR%d s%d", combine_warps_per_row(sp), sp);
      check(name, p, 4, sp);
    }
  }
  if (want("padwarps")) {  // shapes with warps of padding rows only, REGS and shared-memory row state, H_kv 3, row groups 3
    struct C { const char* n; int B, G, H_kv, Q, D, page, P, mp; std::vector<int> lens; std::vector<int> sp; };
    std::vector<C> cs = {
      {"D256 MB3 rows33 Hkv3", 3, 3, 3, 11, 256, 5, 200, 120, {513, 40, 11}, {1, 3, 7}},
      {"D256 MB2 rows17", 2, 1, 1, 17, 256, 9, 100, 60, {300, 17}, {1, 5}},
      {"D256 MB2 rows20", 2, 4, 1, 5, 256, 9, 100, 60, {257, 64}, {1, 3}},
      {"D256 MB3 rows36 decode-like", 1, 12, 1, 3, 256, 16, 40, 30, {450}, {1, 6}},
      {"D256 rg3 MB3 rows130", 1, 10, 2, 13, 256, 11, 60, 40, {400}, {1, 3}},
      {"D64 MB5 rows65 nonREGS", 2, 5, 1, 13, 64, 7, 100, 60, {333, 70}, {1, 3}},
      {"D64 MB7 rows100 nonROOMY", 1, 4, 1, 25, 64, 3, 200, 150, {390}, {1, 2}},
      {"D128 MB1 G8 Q1", 3, 8, 3, 1, 128, 13, 100, 40, {500, 1, 129}, {1, 5}},
      {"D128 MB5 rows66", 1, 6, 1, 11, 128, 17, 50, 30, {300}, {1, 3}},
      {"D64 MB1 rows2 N64", 2, 2, 1, 1, 64, 100, 10, 5, {450, 63}, {1, 3}},
      {"D64 MB2 rows18 N64", 2, 6, 1, 3, 64, 31, 30, 20, {420, 65}, {1, 3}},
    };
    for (auto& c : cs)
      for (int layout = 0; layout < 2; ++layout)
        for (int sp : c.sp) {
          Problem p = make(c.B, c.G * c.H_kv, c.H_kv, c.Q, c.D, c.page, c.P, c.mp, layout, layout == 1);
          p.seq_lens = c.lens;
          if (p.block_table.size() > 7) p.block_table[7] = -1;
          char name[96];
          snprintf(name, sizeof name, "%s L%d s%d", c.n, layout, sp);
          check(name, p, 4, sp);
        }
  }
  if (want("rowgroups")) {  // D256 G8 Q16: 128 rows -> 2 row groups of MB 4
    Problem p = make(1, 8, 1, 16, 256, 16, 8, 8, 0, false);
    p.seq_lens = {100};
    check("rowgroups D256 G8 Q16", p, 2);
  }
  if (want("d64")) {
    Problem p = make(2, 4, 4, 3, 64, 1, 400, 300, 0, true);
    p.seq_lens = {299, 2};
    check("d64 page1 G1 Q3", p, 20);
  }
  if (want("vec8")) {  // interleaved 8-byte aligned K/V, odd page size, bad pages, negative len
    Problem p = make(3, 4, 2, 2, 128, 13, 25, 12, 1, true);
    p.seq_lens = {150, -5, 140};
    p.block_table[3] = -1, p.block_table[5] = 25, p.block_table[12 + 7] = 1 << 30;
    check("vec8 interleaved bad pages", p, 6);
  }
  if (want("big")) {  // D128 G8 Q16 (MB8, 512 threads)
    Problem p = make(1, 8, 1, 16, 128, 64, 10, 6, 0, false);
    p.seq_lens = {380};
    check("big D128 G8 Q16", p, 3);
  }
  if (want("tinyv")) {  // small V codes (e4m3 exponent field <= vexp), v_scale 1, 12 splits: partials
                        // near fp16's subnormals (without the partials' 2^12: 1.6-4.4 of the tolerance)
    for (int vexp : {0, 1}) {
      for (int cfg = 0; cfg < 3; ++cfg) {
        Problem p = cfg == 0 ? make(2, 8, 2, 1, 128, 16, 260, 130, 0, true)
                  : cfg == 1 ? make(1, 6, 1, 8, 256, 16, 260, 130, 0, false)
                             : make(1, 6, 1, 4, 256, 16, 260, 130, 0, false);
        p.seq_lens = cfg == 0 ? std::vector<int>{2000, 1700} : std::vector<int>{2000};
        std::mt19937 r2(7);
        for (size_t i = p.v_off; i < p.kv.size(); ++i) {
          const unsigned r = r2();
          p.kv[i] = (unsigned char)((r & 0x80) | ((r >> 8) % (vexp + 1)) << 3 | ((r >> 16) & 7));
        }
        for (auto& v : p.vs) v = 1.0f;
        for (int kind : {0, 1}) {  // the WMMA kernel; the register-fragment one (D256)
          if (kind == 1 && cfg == 0) continue;
          g_kind = kind;
          char name[96];
          snprintf(name, sizeof name, "tinyv e<=%d cfg%d kind%d s12", vexp, cfg, kind);
          check(name, p, 4, 12);
        }
        g_kind = -1;
      }
    }
  }
  if (want("odd")) {  // D64 G5 Q7 (35 rows, MB3) with many splits
    Problem p = make(2, 10, 2, 7, 64, 7, 50, 40, 0, true);
    p.seq_lens = {270, 6};
    check("odd D64 G5 Q7", p, 40);
  }
  if (want("splits")) {  // forced splits: empty splits, chunk rounding, lengths < Q
    Problem p = make(4, 8, 2, 4, 128, 16, 80, 20, 0, true);
    p.seq_lens = {319, 3, 0, 64};
    check("splits 7", p, 8, 7);
    check("splits 1", p, 8, 1);
    check("splits 13", p, 8, 13);
  }
  if (want("bigpage")) {  // page 1000 (tiles straddle pages), decode G8 D256
    Problem p = make(2, 8, 1, 1, 256, 1000, 3, 2, 0, false);
    p.seq_lens = {1999, 1001};
    check("bigpage decode G8 D256", p, 4, 3);
  }
  if (want("qmis")) {  // 2-byte aligned query (scalar Q loads), splits with row groups
    Problem p = make(2, 16, 2, 16, 256, 48, 12, 5, 0, true);
    p.seq_lens = {240, 17};
    g_q_misaligned = true;
    check("qmis rowgroups D256 G8 Q16 split3", p, 4, 3);
    g_q_misaligned = false;
  }
  if (want("edge")) {  // capacity 0 / no pages / huge page / len > capacity
    Problem p = make(2, 4, 1, 2, 64, 3296, 2, 1, 0, false);
    p.seq_lens = {5000, 3000};
    check("edge page3296 len>cap", p, 4, 2);
    Problem z = make(2, 4, 1, 2, 64, 16, 4, 3, 0, false);
    z.seq_lens = {48, 20};
    for (auto& x : z.block_table) x = -7;
    check("edge all pages invalid", z, 4, 2);
    Problem c = make(2, 4, 1, 2, 64, 16, 4, 0, 0, false);
    c.seq_lens = {48, 0};
    check("edge capacity 0", c, 4);
  }
  if (want("manysplits")) {  // decode G6 D256 page 1648: > 256 splits (two combine batches), empty splits
    Problem p = make(2, 6, 1, 1, 256, 1648, 6, 4, 0, false);
    p.seq_lens = {6000, 1700};
    check("manysplits forced 300", p, 132, 300);
    g_ctas_per_sm = 3;
    check("manysplits plan cps3", p, 132);
    Problem v = make(2, 12, 2, 8, 256, 100, 40, 20, 0, true);  // verify G6 Q8, H_kv 2
    v.seq_lens = {1999, 777};
    check("manysplits verify plan cps3", v, 200);
    g_ctas_per_sm = 2;
  }
  if (want("allcfg")) {  // every (D, MB) with padding rows inside a pass, both load widths, splits 1 and 3
    for (int D : {64, 128, 256})
      for (int mb = 1; mb <= (D == 256 ? 4 : 8); ++mb) {
        const int rows = 16 * mb - (mb == 1 ? 5 : 3);
        // G * Q = rows with H_kv 1: pick Q = rows, G = 1 (causal rows see different lengths)
        for (int layout = 0; layout < 2; ++layout)
          for (int sp : {1, 3}) {
            Problem p = make(2, 1, 1, rows, D, 7, 40, 30, layout, false);
            p.seq_lens = {rows + 90, rows - 2};
            p.block_table[4] = -1;
            char name[64];
            snprintf(name, sizeof name, "allcfg D%d mb%d L%d s%d", D, mb, layout, sp);
            check(name, p, 4, sp);
          }
      }
  }
  if (want("rfkinds")) {  // D256 verify shapes (MB2, MB3, two row groups) on each kernel kind
    const char* kinds[] = {"wmma", "rf-m8n8k4", "rf-m16n8k16"};
    for (int kind = 0; kind < 3; ++kind) {
      g_kind = kind;
      for (int Q : {8, 4, 16, 5})  // 48, 24, 96 (2 x MB3) and 30 rows
        for (int layout = 0; layout < 2; ++layout)
          for (int sp : {1, 4}) {
            Problem p = make(2, 6, 1, Q, 256, 37, 30, 9, layout, layout == 1);
            p.seq_lens = {300, Q + 3};
            p.block_table[3] = -1;
            char name[64];
            snprintf(name, sizeof name, "rfkinds %s Q%d L%d s%d", kinds[kind], Q, layout, sp);
            check(name, p, 4, sp);
          }
    }
    g_kind = -1;
  }
  if (want("rfrescale")) {  // rising scores: a row's max passes m by less and by more than the
    // lazy rescale's threshold (AttnRfTraits::RESCALE_LOG2) within a split, and falls back
    std::mt19937 r(5);
    const char* kinds[] = {"wmma", "rf-m8n8k4", "rf-m16n8k16"};
    for (int kind = 0; kind < 3; ++kind)
      for (int Q : {8, 4})
        for (int sp : {1, 3}) {
          g_kind = kind;
          Problem p = make(2, 6, 1, Q, 256, 16, 80, 40, 0, false);
          p.seq_lens = {600, 250};
          for (auto& x : p.q) x = __half_as_ushort(__float2half_rn(1.0f + frand() * 0.5f));  // positive
          // K of token t: one positive code for all of D, a random walk; at a score of 16 x its
          // value, a step of 1 code moves it by 0.4-23 log2 units, 8 codes (x2) by 3-180.
          static const int steps[] = {-3, 1, 1, 2, 8};
          for (int b = 0; b < p.B; ++b) {
            int code = 0x20;
            for (int t = 0; t < p.max_pages * p.page_size; ++t) {
              if (r() % 16 == 0) code = std::min(std::max(code + steps[r() % 5], 0x18), 0x50);
              const int page = p.block_table[(size_t)b * p.max_pages + t / p.page_size];
              if (page >= 0 && page < p.P) memset(&p.kv[p.k_off + page * p.s_page + (t % p.page_size) * p.s_tok], code, p.D);
            }
          }
          char name[64];
          snprintf(name, sizeof name, "rfrescale %s Q%d s%d", kinds[kind], Q, sp);
          check(name, p, 4, sp);
        }
    g_kind = -1;
  }
  if (want("rffuzz")) {  // random D256 shapes that reach the register-fragment kernel, both atoms
    std::mt19937 r(77);
    const int n = argc > 2 ? atoi(argv[2]) : 20;
    for (int it = 0; it < n; ++it) {
      int G, Q;
      int mb;
      do {
        G = 1 + r() % 8, Q = 1 + r() % 16;
        const int need = (G * Q + 15) / 16, rg = (need + 3) / 4;  // plan.h: row blocks per CTA
        mb = (need + rg - 1) / rg;
      } while (!attn_uses_rf(256, mb));
      const int H_kv = 1 + r() % 2, B = 1 + r() % 3;
      const int page = std::vector<int>{1, 3, 16, 17, 64, 100}[r() % 6];
      const int max_pages = 1 + r() % (400 / page + 1), P = 1 + r() % (B * max_pages + 2);
      Problem p = make(B, G * H_kv, H_kv, Q, 256, page, P, max_pages, r() % 2, r() % 2);
      for (auto& l : p.seq_lens) l = (int)(r() % (max_pages * page + 20)) - 10;
      for (auto& x : p.block_table) if (r() % 20 == 0) x = (r() % 2) ? -1 : P + (int)(r() % 3);
      g_q_misaligned = r() % 3 == 0;
      g_kind = 1 + it % 2;
      char name[64];
      snprintf(name, sizeof name, "rffuzz %d mb%d %s%s", it, mb, g_kind == 1 ? "m8n8k4" : "m16n8k16",
               g_q_misaligned ? " qmis" : "");
      check(name, p, 1 + r() % 100, r() % 3 == 0 ? 0 : 1 + r() % 9);
      g_q_misaligned = false, g_kind = -1;
    }
  }
  if (want("fuzz")) {
    std::mt19937 r(2024);
    const int n = argc > 2 ? atoi(argv[2]) : 30;
    for (int it = 0; it < n; ++it) {
      const int D = 64 << (r() % 3), G = 1 + r() % 8, Q = 1 + r() % 16, H_kv = 1 + r() % 2, B = 1 + r() % 3;
      const int page = std::vector<int>{1, 3, 16, 17, 64, 100}[r() % 6];
      const int max_pages = 1 + r() % (400 / page + 1), P = 1 + r() % (B * max_pages + 2);
      Problem p = make(B, G * H_kv, H_kv, Q, D, page, P, max_pages, r() % 2, r() % 2);
      for (auto& l : p.seq_lens) l = (int)(r() % (max_pages * page + 20)) - 10;
      for (auto& x : p.block_table) if (r() % 20 == 0) x = (r() % 2) ? -1 : P + (int)(r() % 3);
      g_q_misaligned = r() % 3 == 0;
      char name[64];
      snprintf(name, sizeof name, "fuzz %d%s", it, g_q_misaligned ? " qmis" : "");
      check(name, p, 1 + r() % 100, r() % 3 == 0 ? 0 : 1 + r() % 9);
      g_q_misaligned = false;
    }
  }
  if (want("determinism")) {  // random schedules, batch vs alone: bitwise
    // Two schedules of the batch give the same bits, and so does each request run alone.
    auto check_det = [&](Problem& p, int num_sms, unsigned seed1, unsigned seed2, bool& same, bool& alone_ok) {
      emu::rng.seed(seed1);
      const auto o1 = run(p, num_sms);
      emu::rng.seed(seed2);
      same &= o1 == run(p, num_sms);
      const size_t per_b = (size_t)p.H_q * p.Q * p.D;
      for (int b = 0; b < p.B; ++b) {
        Problem s = p;
        s.B = 1;
        s.seq_lens = {p.seq_lens[b]};
        s.block_table.assign(p.block_table.begin() + b * p.max_pages, p.block_table.begin() + (b + 1) * p.max_pages);
        s.q.assign(p.q.begin() + b * per_b, p.q.begin() + (b + 1) * per_b);
        const auto os = run(s, num_sms);
        alone_ok &= std::equal(os.begin(), os.end(), o1.begin() + b * per_b);
      }
    };
    bool same = true, alone_ok = true;
    Problem p = make(3, 8, 2, 4, 128, 16, 60, 16, 0, true);
    p.seq_lens = {200, 31, 256};
    check_det(p, 12, 7, 99, same, alone_ok);
    // again with many splits (combine batches) and the decode plan at 3 CTAs per SM
    g_ctas_per_sm = 3;
    Problem d = make(3, 6, 1, 1, 256, 1648, 8, 3, 0, false);
    d.seq_lens = {4000, 1, 2500};
    check_det(d, 132, 5, 77, same, alone_ok);
    g_ctas_per_sm = 2;
    failures += !(same && alone_ok);
    printf("determinism: schedules %s, batch vs alone %s\n", same ? "same" : "DIFFER", alone_ok ? "same" : "DIFFER");
  }
  printf("families:");
  for (int f = 0; f < kFamilies; ++f)
    if (g_ran[f]) printf(" %s", kFamilyNames[f]);
  printf("\nmma calls %lld computed %lld\n%s\n", emu::mma_calls, emu::mma_computed, failures ? "FAILED" : "ALL OK");
  return failures != 0;
}
