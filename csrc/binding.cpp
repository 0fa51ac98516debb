// Torch binding: CUDA implementations of the sm70attn ops whose schemas are defined in Python
// (torch_sm70attn), plus the hooks of the loader (init, digest, set_validate) and of tests and
// benchmarks. The only file that includes torch. Built by the host C++ compiler alone (no nvcc):
// the kernels, torch-free headers under sm70attn/, are compiled at their first use by NVRTC
// (torch_sm70attn/nvrtc.py) and launched through the driver API (launch.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "launch.h"

// The JIT loader passes the digest as a bare token (-DSM70ATTN_DIGEST=abc123): quotes do not
// survive the build's command line.
#ifndef SM70ATTN_DIGEST
#define SM70ATTN_DIGEST unset
#endif
#define SM70ATTN_STR2(x) #x
#define SM70ATTN_STR(x) SM70ATTN_STR2(x)

namespace py = pybind11;

namespace {

using sm70attn::i64;

std::atomic<bool> g_validate{false};
// Benchmark hook (set_plan_override): plan for this many SMs (0: the device's), and hold at most
// as many CTAs per SM as this much shared memory per SM would (0: the device's own occupancy).
// tools/bench.py sets both to run a V100's grids (80 SMs, 96 KB) on a bigger GPU.
std::atomic<int> g_plan_sms{0}, g_plan_sm_smem{0};
// Test and A/B hook (set_kernel_override): the kernel kind (sm70attn::AttnKind) forced on the
// calls where the register-fragment kernel applies (sm70attn::attn_uses_rf); -1: the default.
std::atomic<int> g_kernel{-1};

// Error messages are built with std::to_string, not iostreams: a toolchain whose libstdc++
// differs from torch's (seen on one GPU machine) crashed formatting integers through
// c10::str, turning a clear ValueError into a segfault.
void put(std::string& s, const char* x) { s += x; }
void put(std::string& s, const std::string& x) { s += x; }
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void put(std::string& s, T x) {
  s += std::to_string(x);
}
void put(std::string& s, c10::IntArrayRef a) {
  s += "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  s += "]";
}
void put(std::string& s, at::ScalarType t) { s += c10::toString(t); }
void put(std::string& s, const c10::Device& d) { s += d.str(); }
template <class... A>
std::string msg(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}

// A stride only matters along a dimension of size > 1.
bool strides_aligned(const at::Tensor& t, int upto, i64 align) {
  for (int d = 0; d < upto; ++d)
    if (t.size(d) > 1 && t.stride(d) % align != 0) return false;
  return true;
}

bool ptr_aligned(const at::Tensor& t, i64 align) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0;
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, msg(name, " must be contiguous in its last dim, got strides ",
                    t.strides()));
}

void check_device(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == ref.device(), msg(name, " must be on ", ref.device(), ", got ",
                    t.device()));
}

// k_scale / v_scale: float32 with one element or one per KV head; returns the element stride.
int scale_stride(const at::Tensor& s, i64 h_kv, const at::Tensor& ref, const char* name) {
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, msg(name, " must be float32, got ", s.scalar_type()));
  TORCH_CHECK_VALUE(s.numel() == 1 || (s.dim() == 1 && s.size(0) == h_kv), msg(name,
                    " must have 1 element or H_kv = ", h_kv, ", got shape ", s.sizes()));
  check_device(s, ref, name);
  TORCH_CHECK_VALUE(s.numel() == 1 || s.stride(0) <= INT_MAX, msg(name, " stride too large"));
  return s.numel() == 1 ? 0 : (int)s.stride(0);
}


// --- The driver API, from libcuda (dlopen'd at the first launch, as torch's own users of the driver
// do: a binding built without the toolkit links none of it).
struct HostDriver {
  sm70attn::Driver launch;
  decltype(&::cuDeviceGetAttribute) attribute = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;
  decltype(&::cuModuleLoadData) load_module = nullptr;
  decltype(&::cuModuleGetFunction) get_function = nullptr;
};

const HostDriver& driver() {
  static const HostDriver d = [] {
    HostDriver h;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib, msg("torch_sm70attn: cannot load the CUDA driver (libcuda.so.1): ", dlerror()));
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      TORCH_CHECK(fn, msg("torch_sm70attn: the CUDA driver has no ", name));
    };
    sym(h.launch.launch, "cuLaunchKernel");
    sym(h.launch.set_attribute, "cuFuncSetAttribute");
    sym(h.launch.occupancy, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    sym(h.attribute, "cuDeviceGetAttribute");
    sym(h.error_string, "cuGetErrorString");
    sym(h.load_module, "cuModuleLoadData");
    sym(h.get_function, "cuModuleGetFunction");
    return h;
  }();
  return d;
}

void check_cu(CUresult err, const char* what) {
  if (err == CUDA_SUCCESS) return;
  const char* s = nullptr;
  driver().error_string(err, &s);
  TORCH_CHECK(false, msg(what, ": ", s ? s : "unknown CUDA error", " (CUresult ", (int)err, ")"));
}

// --- Set by torch_sm70attn at load (init): the kernel loader, the reference route, the manifest.
// Python objects are never freed: they must not be released without the GIL at exit.
py::object* g_fetch = nullptr;     // torch_sm70attn.nvrtc.fetch(family, params, device) -> (cubin, symbol)
py::object* g_fallback = nullptr;  // torch_sm70attn.ops.cuda_fallback(*paged_attention's args, rule) -> Tensor
py::object* g_fallback_varlen = nullptr;  // ops.cuda_fallback_varlen(*paged_attention_varlen's args, rule)

// The capability manifest (torch_sm70attn/manifest.py, the one place it is written): the shapes a
// call may take the kernels for (route_refusal).
struct Bounds {
  std::vector<int> head_dims;
  i64 group_mask = 0, rows_mask = 0;  // bit n: n admitted (group sizes, query rows; at most 62)
  i64 max_context = 0;
  int min_cc = 0;
} g_bounds;

bool in_mask(i64 mask, i64 n) { return n >= 0 && n < 63 && (mask >> n & 1); }

// The loader: the kernel's cubin (compiled by NVRTC at its first use, or from the disk cache)
// from torch_sm70attn.nvrtc.fetch, loaded here into the device's context (current: the callers
// hold a device guard). Modules stay loaded for the life of the process. The driver is called
// from here, not through cuda-bindings, whose first use probes dozens of entry points this
// driver may lack: each is a failed API call under compute-sanitizer.
CUfunction load_kernel(const sm70attn::KernelKey& k, int device) {
  std::string error, cubin, symbol;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_fetch, "torch_sm70attn: the CUDA library was not initialised (call torch_sm70attn.ops.load_cuda_kernels())");
    try {
      py::tuple params(k.n);
      for (int i = 0; i < k.n; ++i) params[i] = k.params[i];
      const py::tuple got = (*g_fetch)(k.family, params, device);
      cubin = got[0].cast<std::string>(), symbol = got[1].cast<std::string>();
    } catch (py::error_already_set& e) {
      error = e.what();
    }
  }
  TORCH_CHECK(error.empty(), msg(error));
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  CUresult err = driver().load_module(&module, cubin.data());
  if (err == CUDA_SUCCESS) err = driver().get_function(&f, module, symbol.c_str());
  if (err != CUDA_SUCCESS && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
    check_cu(err, msg("loading ", k.family, " inside a CUDA graph capture (make the same call once before capturing)").c_str());
  check_cu(err, msg("loading ", k.family, " (", symbol, ")").c_str());
  return f;
}

sm70attn::Launcher launcher(int device) {
  return {&driver().launch, &load_kernel, device, c10::cuda::getCurrentCUDAStream(device).stream()};
}

// Per device, asked once: compute capability (10 major + minor) and SMs.
struct DeviceInfo {
  int cc = 0, num_sms = 0;
};

const DeviceInfo& device_info(int device) {
  static DeviceInfo cache[sm70attn::kMaxDevices];
  static std::once_flag once[sm70attn::kMaxDevices];
  TORCH_CHECK(device >= 0 && device < sm70attn::kMaxDevices, msg("torch_sm70attn: device ", device, " out of range"));
  std::call_once(once[device], [&] {
    int major = 0, minor = 0;
    DeviceInfo& d = cache[device];
    check_cu(driver().attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute");
    check_cu(driver().attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute");
    check_cu(driver().attribute(&d.num_sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device), "cuDeviceGetAttribute");
    d.cc = 10 * major + minor;
  });
  return cache[device];
}

// A cache whose rows all start 8-byte (16-byte) aligned: the kernels' narrowest (widest) KV loads.
bool cache_aligned(const at::Tensor& t, i64 align) { return ptr_aligned(t, align) && strides_aligned(t, 3, align); }

// The route of a call: the name of the first rule of torch_sm70attn/routes.py's RULES it fails,
// of those applied here ("binding"), in that table's order and under its names (tests/test_routes.py
// reads them from this function), or nullptr: the kernels take it. The route is decided here
// alone; routes.admit predicts it from metadata, and ops.cuda_fallback words the reason.
const char* route_refusal(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          i64 G, i64 Q, i64 D, i64 page_size, i64 capacity) {
  if (device_info(query.get_device()).cc < g_bounds.min_cc) return "compute capability";
  if (std::find(g_bounds.head_dims.begin(), g_bounds.head_dims.end(), D) == g_bounds.head_dims.end())
    return "head dim";
  if (!in_mask(g_bounds.group_mask, G)) return "group size";
  if (!in_mask(g_bounds.rows_mask, Q)) return "query rows";
  // Whole pages covering the contract (manifest.admitted_capacity with no served capacity).
  if (capacity > (g_bounds.max_context + page_size - 1) / std::max<i64>(page_size, 1) * page_size)
    return "table capacity";
  if (!cache_aligned(key_cache, 8)) return "key_cache alignment";
  if (!cache_aligned(value_cache, 8)) return "value_cache alignment";
  return nullptr;
}

int device_attribute(int device, CUdevice_attribute a) {
  int v = 0;
  check_cu(driver().attribute(&v, a, device), "cuDeviceGetAttribute");
  return v;
}

// Names of the kernel kinds, by sm70attn::AttnKind (set_kernel_override takes them, plan() reports them).
constexpr const char* kKindNames[] = {"wmma", "rf-m8n8k4", "rf-m16n8k16"};

// The attention kernel kind of a call (sm70attn::attn_default_kind), or the one
// set_kernel_override forces where it applies (tests and A/B runs). Shapes outside
// attn_uses_rf have the WMMA kernel only.
int kernel_kind(int device, int d, int mb, i64 capacity) {
  if (!sm70attn::attn_uses_rf(d, mb)) return sm70attn::ATTN_WMMA;
  const int cc = device_info(device).cc, forced = g_kernel.load();
  if (forced < 0) return sm70attn::attn_default_kind(d, mb, cc, capacity);
  TORCH_CHECK_VALUE(forced != sm70attn::ATTN_RF_M16N8K16 || cc >= 80,
                    msg("paged_attention: set_kernel_override('rf-m16n8k16') needs SM80 or newer, device ", device,
                        " is SM", cc, "; set 'auto' or 'rf-m8n8k4'"));
  return forced;
}

// sm70attn::attn_ctas_per_sm, cached per (device, kind, D, mb, vec): the query loads the kernel.
int ctas_per_sm(const sm70attn::Launcher& l, int kind, int d, int mb, int vec) {
  static std::atomic<int> cache[sm70attn::kMaxDevices][3][3][9][2];  // 0: not yet asked
  const int device = l.device;
  if (device < 0 || device >= sm70attn::kMaxDevices || kind < 0 || kind > 2 || mb < 1 || mb > 8 ||
      (d != 64 && d != 128 && d != 256))
    return sm70attn::attn_ctas_per_sm(l, kind, d, mb, vec);
  std::atomic<int>& c = cache[device][kind][d == 64 ? 0 : d == 128 ? 1 : 2][mb][vec == 16];
  int n = c.load(std::memory_order_relaxed);
  if (n == 0) {
    n = std::max(sm70attn::attn_ctas_per_sm(l, kind, d, mb, vec), 1);
    c.store(n, std::memory_order_relaxed);
  }
  return n;
}

// The plan of a call on this device, with the occupancy it was sized for and the dynamic shared
// memory to launch with (0: the kernel's own).
struct CallPlan {
  sm70attn::AttnPlan plan;
  int kind = 0, num_sms = 0, ctas_per_sm = 0, smem_bytes = 0;
};

CallPlan plan_call(const sm70attn::Launcher& l, i64 B, i64 H_q, i64 H_kv, i64 Q, i64 D, i64 capacity, int vec) {
  CallPlan c;
  const int device = l.device;
  c.num_sms = device_info(device).num_sms;
  // (set the override while no other thread launches: the two values are read separately)
  if (const int sms = g_plan_sms.load(); sms > 0) c.num_sms = sms;
  // Splits follow the kernel's occupancy on this device (a property of (D, mb, vec), the kind and the GPU
  // only: the plan stays independent of B and of seq_lens values).
  const int mb = sm70attn::plan_paged_attention((int)B, (int)H_q, (int)H_kv, (int)Q, (int)D, capacity, c.num_sms).mb;
  c.kind = kernel_kind(device, (int)D, mb, capacity);
  c.ctas_per_sm = ctas_per_sm(l, c.kind, (int)D, mb, vec);
  if (const int sm_smem = g_plan_sm_smem.load(); sm_smem > 0) {
    // As many CTAs as sm_smem holds, and a padded launch so that this device holds no more.
    const int own = sm70attn::attn_smem_bytes(c.kind, (int)D, mb, vec);
    TORCH_CHECK_VALUE(sm_smem >= own, msg("set_plan_override: sm_smem_bytes = ", sm_smem,
                      " holds no CTA of the D = ", D, " kernel (", own, " bytes of shared memory); a V100 has 98304"));
    const int dev_smem = device_attribute(device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
    const int reserved = device_attribute(device, CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK);
    const int optin = device_attribute(device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    const int want = std::max(1, std::min(c.ctas_per_sm, sm_smem / std::max(own, 1)));
    c.smem_bytes = std::max(own, std::min(optin, dev_smem / want - reserved));
    c.ctas_per_sm = std::max(1, sm70attn::attn_ctas_per_sm(l, c.kind, (int)D, mb, vec, c.smem_bytes));
  }
  c.plan = sm70attn::plan_paged_attention((int)B, (int)H_q, (int)H_kv, (int)Q, (int)D, capacity, c.num_sms,
                                          c.ctas_per_sm);
  return c;
}

// Host-side check of the values the kernel otherwise clamps/skips (validate mode only).
void validate_lengths_and_pages(const at::Tensor& seq_lens, const at::Tensor& block_table, i64 page_size,
                                i64 capacity, i64 num_pages) {
  const at::Tensor lens = seq_lens.cpu(), bt = block_table.cpu();
  const auto l = lens.accessor<int, 1>();
  const auto t = bt.accessor<int, 2>();
  for (i64 b = 0; b < l.size(0); ++b) {
    const i64 len = l[b];
    TORCH_CHECK_VALUE(len >= 0 && len <= capacity, msg("seq_lens[", b, "] = ", len, " is outside [0, capacity = ",
                      capacity, "] (capacity = block_table.size(1) * page_size)"));
    const i64 pages = (len + page_size - 1) / page_size;
    for (i64 i = 0; i < pages; ++i)
      TORCH_CHECK_VALUE(t[b][i] >= 0 && t[b][i] < num_pages, msg("block_table[", b, ", ", i, "] = ", t[b][i],
                        " is outside [0, num_pages = ", num_pages, ") (used by seq_lens[", b, "] = ", len, ")"));
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                           const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK_TYPE(query.scalar_type() == at::kHalf, msg("query must be float16, got ", query.scalar_type()));
  TORCH_CHECK_TYPE(key_cache.scalar_type() == at::kFloat8_e4m3fn, msg("key_cache must be float8_e4m3fn, got ",
                   key_cache.scalar_type()));
  TORCH_CHECK_TYPE(value_cache.scalar_type() == at::kFloat8_e4m3fn, msg("value_cache must be float8_e4m3fn, got ",
                   value_cache.scalar_type()));
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, msg("block_table must be int32, got ",
                   block_table.scalar_type()));
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt, msg("seq_lens must be int32, got ", seq_lens.scalar_type()));
  TORCH_CHECK_VALUE(query.dim() == 4, msg("query must be [B, H_q, Q, D], got shape ", query.sizes()));
  TORCH_CHECK_VALUE(key_cache.dim() == 4, msg("key_cache must be [P, page_size, H_kv, D], got shape ",
                    key_cache.sizes()));
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), msg("value_cache shape ", value_cache.sizes(),
                    " != key_cache shape ", key_cache.sizes()));
  TORCH_CHECK_VALUE(block_table.dim() == 2, msg("block_table must be [B, max_pages], got shape ", block_table.sizes()));
  TORCH_CHECK_VALUE(seq_lens.dim() == 1, msg("seq_lens must be [B], got shape ", seq_lens.sizes()));

  const i64 B = query.size(0), H_q = query.size(1), Q = query.size(2), D = query.size(3);
  const i64 P = key_cache.size(0), page_size = key_cache.size(1), H_kv = key_cache.size(2);
  const i64 max_pages = block_table.size(1);
  TORCH_CHECK_VALUE(key_cache.size(3) == D, msg("key_cache head dim ", key_cache.size(3), " != query head dim ", D));
  TORCH_CHECK_VALUE(H_kv > 0 && H_q % H_kv == 0, msg("query heads H_q = ", H_q,
                    " must be a multiple of the KV heads H_kv = ", H_kv));
  TORCH_CHECK_VALUE(block_table.size(0) == B && seq_lens.size(0) == B, msg("block_table rows (", block_table.size(0),
                    ") and seq_lens size (", seq_lens.size(0), ") must equal the batch size B = ", B));
  check_last_dim_contiguous(query, "query");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  check_last_dim_contiguous(block_table, "block_table");
  TORCH_CHECK_VALUE(query.is_cuda(), msg("query must be a CUDA tensor, got ", query.device()));
  check_device(key_cache, query, "key_cache");
  check_device(value_cache, query, "value_cache");
  check_device(block_table, query, "block_table");
  check_device(seq_lens, query, "seq_lens");
  const int ks_stride = scale_stride(k_scale, H_kv, query, "k_scale");
  const int vs_stride = scale_stride(v_scale, H_kv, query, "v_scale");

  // The route: a call that fails a rule runs the reference, handed the rule's name (Python only on
  // this path: an admitted call never enters the interpreter).
  const i64 G = H_q / H_kv, capacity = max_pages * page_size;
  if (const char* rule = route_refusal(query, key_cache, value_cache, G, Q, D, page_size, capacity)) {
    TORCH_CHECK(g_fallback, "torch_sm70attn: the CUDA library was not initialised");
    py::gil_scoped_acquire gil;
    return (*g_fallback)(query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale, rule)
        .cast<at::Tensor>();
  }
  // The kernels' token arithmetic is int32, with headroom for a split's rounding (len + splits -
  // 1, t + N): capacity stays 1024 below INT_MAX (only a page of billions of tokens gets here).
  const i64 max_capacity = (i64)INT_MAX - 1024;
  TORCH_CHECK_VALUE(capacity <= max_capacity && P <= INT_MAX,
                    msg("capacity (max_pages * page_size = ", capacity, ") must be at most ", max_capacity,
                        " and num_pages (", P, ") must fit in int32"));
  // 16-byte KV loads when every row start allows them
  const int vec = cache_aligned(key_cache, 16) && cache_aligned(value_cache, 16) ? 16 : 8;

  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty({B, H_q, Q, D}, query.options());
  if (B == 0 || H_q == 0) return out;
  const int device = query.get_device();
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device);

  if (g_validate.load() && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None)
    validate_lengths_and_pages(seq_lens, block_table, page_size, capacity, P);

  const sm70attn::Launcher l{&driver().launch, &load_kernel, device, stream.stream()};
  const CallPlan call = plan_call(l, B, H_q, H_kv, Q, D, capacity, vec);
  const sm70attn::AttnPlan& plan = call.plan;
  TORCH_CHECK_VALUE(B * H_kv * plan.row_groups <= INT_MAX && B * H_q * Q <= INT_MAX, msg("batch B = ", B,
                    " is too large for the launch grid"));
  at::Tensor workspace;
  if (plan.workspace_floats > 0)
    workspace = at::empty({plan.workspace_floats}, query.options().dtype(at::kFloat));

  sm70attn::PagedAttnParams p{};
  p.q = reinterpret_cast<const __half*>(query.data_ptr<at::Half>());
  p.q_stride_b = query.stride(0), p.q_stride_h = query.stride(1), p.q_stride_r = query.stride(2);
  p.k = reinterpret_cast<const unsigned char*>(key_cache.data_ptr());
  p.v = reinterpret_cast<const unsigned char*>(value_cache.data_ptr());
  p.k_stride_page = key_cache.stride(0), p.k_stride_tok = key_cache.stride(1), p.k_stride_head = key_cache.stride(2);
  p.v_stride_page = value_cache.stride(0), p.v_stride_tok = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride_b = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.seq_lens_stride = seq_lens.stride(0);
  p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
  p.k_scale_stride = ks_stride, p.v_scale_stride = vs_stride;
  p.out = reinterpret_cast<__half*>(out.data_ptr<at::Half>());
  p.B = (int)B, p.H_q = (int)H_q, p.H_kv = (int)H_kv, p.G = (int)G, p.Q = (int)Q, p.D = (int)D;
  p.page_size = (int)page_size, p.max_pages = (int)max_pages, p.num_pages = (int)P;
  p.rows = (int)(G * Q);
  p.row_groups = plan.row_groups, p.num_splits = plan.num_splits;
  p.scale_log2 = (float)(scale * 1.4426950408889634);  // log2(e)
  p.q_vec16 = ptr_aligned(query, 16) && strides_aligned(query, 3, 8);
  sm70attn::set_workspace(p, plan.workspace_floats > 0 ? workspace.data_ptr<float>() : nullptr);
  check_cu(sm70attn::launch_paged_attention(l, p, call.kind, plan.mb, vec, call.smem_bytes), "paged_attention launch");
  return out;
}

// paged_attention_varlen: the checks paged_attention makes of the caches, table, lengths and
// scales, and of query [T, H_q, D] and query_start_loc [B + 1]; the route by the same rules
// (query rows: one); one launch of the varlen tile loop (and of its combine where requests split).
// No value of the metadata is read on the host (validate mode aside): varlen.h says what the
// kernel makes of any values.
at::Tensor paged_attention_varlen(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_table, const at::Tensor& query_start_loc,
                                  const at::Tensor& seq_lens, double scale, const at::Tensor& k_scale,
                                  const at::Tensor& v_scale) {
  TORCH_CHECK_TYPE(query.scalar_type() == at::kHalf, msg("query must be float16, got ", query.scalar_type()));
  TORCH_CHECK_TYPE(key_cache.scalar_type() == at::kFloat8_e4m3fn, msg("key_cache must be float8_e4m3fn, got ",
                   key_cache.scalar_type()));
  TORCH_CHECK_TYPE(value_cache.scalar_type() == at::kFloat8_e4m3fn, msg("value_cache must be float8_e4m3fn, got ",
                   value_cache.scalar_type()));
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, msg("block_table must be int32, got ",
                   block_table.scalar_type()));
  TORCH_CHECK_TYPE(query_start_loc.scalar_type() == at::kInt, msg("query_start_loc must be int32, got ",
                   query_start_loc.scalar_type()));
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt, msg("seq_lens must be int32, got ", seq_lens.scalar_type()));
  TORCH_CHECK_VALUE(query.dim() == 3, msg("query must be [T, H_q, D], got shape ", query.sizes()));
  TORCH_CHECK_VALUE(key_cache.dim() == 4, msg("key_cache must be [P, page_size, H_kv, D], got shape ",
                    key_cache.sizes()));
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), msg("value_cache shape ", value_cache.sizes(),
                    " != key_cache shape ", key_cache.sizes()));
  TORCH_CHECK_VALUE(block_table.dim() == 2, msg("block_table must be [B, max_pages], got shape ", block_table.sizes()));
  TORCH_CHECK_VALUE(seq_lens.dim() == 1, msg("seq_lens must be [B], got shape ", seq_lens.sizes()));
  const i64 T = query.size(0), H_q = query.size(1), D = query.size(2), B = seq_lens.size(0);
  const i64 P = key_cache.size(0), page_size = key_cache.size(1), H_kv = key_cache.size(2);
  const i64 max_pages = block_table.size(1);
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) == B + 1, msg("query_start_loc must be [B + 1 = ",
                    B + 1, "], got shape ", query_start_loc.sizes()));
  TORCH_CHECK_VALUE(key_cache.size(3) == D, msg("key_cache head dim ", key_cache.size(3), " != query head dim ", D));
  TORCH_CHECK_VALUE(H_kv > 0 && H_q % H_kv == 0, msg("query heads H_q = ", H_q,
                    " must be a multiple of the KV heads H_kv = ", H_kv));
  TORCH_CHECK_VALUE(block_table.size(0) == B, msg("block_table has ", block_table.size(0), " rows, seq_lens ", B));
  TORCH_CHECK_VALUE(page_size > 0, "key_cache page_size (dim 1) must be >= 1");
  check_last_dim_contiguous(query, "query");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  check_last_dim_contiguous(block_table, "block_table");
  TORCH_CHECK_VALUE(query.is_cuda(), msg("query must be a CUDA tensor, got ", query.device()));
  check_device(key_cache, query, "key_cache");
  check_device(value_cache, query, "value_cache");
  check_device(block_table, query, "block_table");
  check_device(query_start_loc, query, "query_start_loc");
  check_device(seq_lens, query, "seq_lens");
  const int ks_stride = scale_stride(k_scale, H_kv, query, "k_scale");
  const int vs_stride = scale_stride(v_scale, H_kv, query, "v_scale");

  const i64 G = H_q / H_kv, capacity = max_pages * page_size;
  if (const char* rule = route_refusal(query, key_cache, value_cache, G, 1, D, page_size, capacity)) {
    TORCH_CHECK(g_fallback_varlen, "torch_sm70attn: the CUDA library was not initialised");
    py::gil_scoped_acquire gil;
    return (*g_fallback_varlen)(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale,
                                v_scale, rule)
        .cast<at::Tensor>();
  }
  const i64 max_capacity = (i64)INT_MAX - 1024;
  TORCH_CHECK_VALUE(capacity <= max_capacity && P <= INT_MAX,
                    msg("capacity (max_pages * page_size = ", capacity, ") must be at most ", max_capacity,
                        " and num_pages (", P, ") must fit in int32"));
  TORCH_CHECK_VALUE(T * G <= INT_MAX / 2 && B <= INT_MAX / 2, msg("T = ", T, " tokens and B = ", B,
                    " requests are too many for the launch grid"));
  const int vec = cache_aligned(key_cache, 16) && cache_aligned(value_cache, 16) ? 16 : 8;

  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty({T, H_q, D}, query.options());
  if (T == 0 || H_q == 0) return out;
  const int device = query.get_device();
  if (g_validate.load() && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    validate_lengths_and_pages(seq_lens, block_table, page_size, capacity, P);
    const at::Tensor qsl = query_start_loc.cpu();
    const auto a = qsl.accessor<int, 1>();
    TORCH_CHECK_VALUE(a[0] == 0, msg("query_start_loc[0] must be 0, got ", a[0]));
    for (i64 b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(a[b + 1] >= a[b], msg("query_start_loc must be non-decreasing, got query_start_loc[", b,
                        "] = ", a[b], " > query_start_loc[", b + 1, "] = ", a[b + 1]));
    TORCH_CHECK_VALUE(a[B] <= T, msg("query_start_loc[B] = ", a[B], " exceeds the query's T = ", T, " tokens"));
  }
  const sm70attn::Launcher l = launcher(device);
  int num_sms = device_info(device).num_sms;
  if (const int sms = g_plan_sms.load(); sms > 0) num_sms = sms;
  const int ctas = std::max(1, sm70attn::varlen_ctas_per_sm(l, (int)D, vec));
  const sm70attn::VarlenPlan plan =
      sm70attn::plan_paged_attention_varlen(T, B, (int)H_q, (int)H_kv, (int)D, capacity, num_sms, ctas);
  TORCH_CHECK_VALUE(plan.tiles * H_kv <= INT_MAX, msg("T = ", T, " tokens are too many for the launch grid"));
  at::Tensor workspace;
  if (plan.workspace_floats > 0) {
    workspace = at::empty({plan.workspace_floats}, query.options().dtype(at::kFloat));
    workspace.narrow(0, plan.workspace_floats - 4ll * plan.units, 4ll * plan.units).zero_();  // the unit heads
  }

  sm70attn::PagedAttnParams p{};
  p.q = reinterpret_cast<const __half*>(query.data_ptr<at::Half>());
  p.q_stride_b = query.stride(0), p.q_stride_h = query.stride(1), p.q_stride_r = 0;
  p.k = reinterpret_cast<const unsigned char*>(key_cache.data_ptr());
  p.v = reinterpret_cast<const unsigned char*>(value_cache.data_ptr());
  p.k_stride_page = key_cache.stride(0), p.k_stride_tok = key_cache.stride(1), p.k_stride_head = key_cache.stride(2);
  p.v_stride_page = value_cache.stride(0), p.v_stride_tok = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride_b = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.seq_lens_stride = seq_lens.stride(0);
  p.qsl = query_start_loc.data_ptr<int>();
  p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
  p.k_scale_stride = ks_stride, p.v_scale_stride = vs_stride;
  p.out = reinterpret_cast<__half*>(out.data_ptr<at::Half>());
  p.B = (int)B, p.H_q = (int)H_q, p.H_kv = (int)H_kv, p.G = (int)G, p.Q = 1, p.D = (int)D, p.T = (int)T;
  p.page_size = (int)page_size, p.max_pages = (int)max_pages, p.num_pages = (int)P;
  p.rows = (int)G, p.row_groups = 1, p.num_splits = 1;
  p.split_cap = plan.split_cap, p.split_tokens = plan.split_tokens, p.split_q = plan.split_q;
  p.split_target = plan.split_target, p.units = plan.units;
  p.scale_log2 = (float)(scale * 1.4426950408889634);
  p.q_vec16 = ptr_aligned(query, 16) && strides_aligned(query, 2, 8);
  sm70attn::set_varlen_workspace(p, plan.workspace_floats > 0 ? workspace.data_ptr<float>() : nullptr);
  check_cu(sm70attn::launch_paged_attention_varlen(l, p, plan, vec), "paged_attention_varlen launch");
  return out;
}

void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
              const at::Tensor& v_scale) {
  TORCH_CHECK_TYPE(key.scalar_type() == at::kHalf, msg("key must be float16, got ", key.scalar_type()));
  TORCH_CHECK_TYPE(value.scalar_type() == at::kHalf, msg("value must be float16, got ", value.scalar_type()));
  TORCH_CHECK_TYPE(key_cache.scalar_type() == at::kFloat8_e4m3fn, msg("key_cache must be float8_e4m3fn, got ",
                   key_cache.scalar_type()));
  TORCH_CHECK_TYPE(value_cache.scalar_type() == at::kFloat8_e4m3fn, msg("value_cache must be float8_e4m3fn, got ",
                   value_cache.scalar_type()));
  TORCH_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong, msg("slot_mapping must be int64, got ",
                   slot_mapping.scalar_type()));
  TORCH_CHECK_VALUE(key.dim() == 3, msg("key must be [T, H_kv, D], got shape ", key.sizes()));
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), msg("value shape ", value.sizes(), " != key shape ", key.sizes()));
  TORCH_CHECK_VALUE(key_cache.dim() == 4, msg("key_cache must be [P, page_size, H_kv, D], got shape ",
                    key_cache.sizes()));
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), msg("value_cache shape ", value_cache.sizes(),
                    " != key_cache shape ", key_cache.sizes()));
  const i64 T = key.size(0), H_kv = key.size(1), D = key.size(2);
  const i64 P = key_cache.size(0), page_size = key_cache.size(1);
  TORCH_CHECK_VALUE(key_cache.size(2) == H_kv && key_cache.size(3) == D, msg("key_cache [P, page_size, H_kv, D] = ",
                    key_cache.sizes(), " does not match key [T, H_kv, D] = ", key.sizes()));
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == T, msg("slot_mapping must be [T = ", T,
                    "], got shape ", slot_mapping.sizes()));
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  TORCH_CHECK_VALUE(key.is_cuda(), msg("key must be a CUDA tensor, got ", key.device()));
  check_device(value, key, "value");
  check_device(key_cache, key, "key_cache");
  check_device(value_cache, key, "value_cache");
  check_device(slot_mapping, key, "slot_mapping");
  const int ks_stride = scale_stride(k_scale, H_kv, key, "k_scale");
  const int vs_stride = scale_stride(v_scale, H_kv, key, "v_scale");
  TORCH_CHECK_VALUE(T <= INT_MAX && P <= INT_MAX && page_size <= INT_MAX && H_kv <= INT_MAX && D <= INT_MAX, msg("store_kv sizes must fit in int32"));
  if (T == 0 || H_kv == 0 || D == 0) return;
  const i64 items = T * H_kv * D;
  TORCH_CHECK_VALUE(items / sm70attn::StoreKVTraits::THREADS < INT_MAX, msg("store_kv: too many elements"));

  sm70attn::StoreKVParams p{};
  p.key = reinterpret_cast<const __half*>(key.data_ptr<at::Half>());
  p.value = reinterpret_cast<const __half*>(value.data_ptr<at::Half>());
  p.key_stride_t = key.stride(0), p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0), p.value_stride_h = value.stride(1);
  p.k_cache = reinterpret_cast<unsigned char*>(key_cache.data_ptr());
  p.v_cache = reinterpret_cast<unsigned char*>(value_cache.data_ptr());
  p.kc_stride_page = key_cache.stride(0), p.kc_stride_tok = key_cache.stride(1);
  p.kc_stride_head = key_cache.stride(2);
  p.vc_stride_page = value_cache.stride(0), p.vc_stride_tok = value_cache.stride(1);
  p.vc_stride_head = value_cache.stride(2);
  p.slot_mapping = reinterpret_cast<const i64*>(slot_mapping.data_ptr<int64_t>());
  p.slot_stride = slot_mapping.stride(0);
  p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
  p.k_scale_stride = ks_stride, p.v_scale_stride = vs_stride;
  p.T = (int)T, p.H_kv = (int)H_kv, p.D = (int)D, p.page_size = (int)page_size, p.num_pages = (int)P;
  // 16-byte fp16 loads and 8-byte e4m3 stores when every row allows them.
  p.vec8 = D % 8 == 0 && ptr_aligned(key, 16) && ptr_aligned(value, 16) && strides_aligned(key, 2, 8) &&
           strides_aligned(value, 2, 8) && ptr_aligned(key_cache, 8) && ptr_aligned(value_cache, 8) &&
           strides_aligned(key_cache, 3, 8) && strides_aligned(value_cache, 3, 8);

  const c10::cuda::CUDAGuard guard(key.device());
  const int device = key.get_device();
  const sm70attn::Launcher l{&driver().launch, &load_kernel, device, c10::cuda::getCurrentCUDAStream(device).stream()};
  check_cu(sm70attn::launch_store_kv(l, p), "store_kv launch");
}

// Test hook (mma_atom_check): D = A B + C through one MMA atom and its element maps.
// Its operands' shapes, from the atom (csrc/sm70attn/mma_atoms.h: device code, not included here).
template <int SHAPE>
struct Atom {
  static constexpr int GROUPS = SHAPE == 16816 ? 1 : 4, M = SHAPE == 16816 ? 16 : 8, N = 8, K = SHAPE == 16816 ? 16 : 4;
};

template <int SHAPE>
at::Tensor mma_atom_check_t(const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  using At = Atom<SHAPE>;
  const std::vector<int64_t> sa{At::GROUPS, At::M, At::K}, sb{At::GROUPS, At::K, At::N}, sc{At::GROUPS, At::M, At::N};
  TORCH_CHECK_VALUE(A.is_cuda() && B.is_cuda() && C.is_cuda() && A.device() == B.device() && A.device() == C.device(),
                    "mma_atom_check: A, B and C must be on one CUDA device");
  TORCH_CHECK_VALUE(A.scalar_type() == at::kHalf && B.scalar_type() == at::kHalf && C.scalar_type() == at::kFloat,
                    "mma_atom_check: A and B float16, C float32");
  TORCH_CHECK_VALUE(A.sizes().vec() == sa && B.sizes().vec() == sb && C.sizes().vec() == sc && A.is_contiguous() &&
                        B.is_contiguous() && C.is_contiguous(),
                    msg("mma_atom_check: contiguous A [", At::GROUPS, ", ", At::M, ", ", At::K, "], B [", At::GROUPS,
                        ", ", At::K, ", ", At::N, "], C [", At::GROUPS, ", ", At::M, ", ", At::N, "]"));
  const c10::cuda::CUDAGuard guard(A.device());
  at::Tensor D = at::empty_like(C);
  D.fill_(std::nanf(""));  // poisoned: an element no lane writes stays NaN
  const sm70attn::Launcher l = launcher(A.get_device());
  using K = sm70attn::MmaCheckKernel<SHAPE>;
  CUfunction f = nullptr;
  check_cu(sm70attn::function<K>(l, &f), "mma_atom_check");
  const void *a = A.data_ptr(), *b = B.data_ptr(), *c = C.data_ptr();
  void* d = D.data_ptr();
  void* args[] = {&a, &b, &c, &d};
  check_cu(l.drv->launch(f, 1, 1, 1, K::THREADS, 1, 1, 0, l.stream, args, nullptr), "mma_atom_check launch");
  return D;
}

at::Tensor mma_atom_check(int64_t shape, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  TORCH_CHECK_VALUE(shape == 884 || shape == 8844 || shape == 16816,
                    "mma_atom_check: shape 884 (m8n8k4), 8844 (m8n8k4 with B row-major) or 16816 (m16n8k16)");
  if (shape == 884) return mma_atom_check_t<884>(A, B, C);
  if (shape == 8844) return mma_atom_check_t<8844>(A, B, C);
  TORCH_CHECK_VALUE(A.is_cuda(), "mma_atom_check: A, B and C must be on one CUDA device");
  TORCH_CHECK_VALUE(device_info(A.get_device()).cc >= 80, "mma_atom_check: m16n8k16 needs SM80 or newer");
  return mma_atom_check_t<16816>(A, B, C);
}

}  // namespace

// Tests only, in a namespace of its own (tensors cross into C++ through the dispatcher, as the
// ops' do): D = A B + C per group through one mma.sync atom (884: m8n8k4, 4 groups of 8x8x4;
// 8844: the same with B row-major; 16816: m16n8k16, one group of 16x8x16) and the element maps of csrc/sm70attn/mma_atoms.h.
TORCH_LIBRARY(sm70attn_test, m) {
  m.def("mma_atom_check(int shape, Tensor A, Tensor B, Tensor C) -> Tensor", &mma_atom_check);
}

TORCH_LIBRARY_IMPL(sm70attn, CUDA, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_varlen", &paged_attention_varlen);
  m.impl("store_kv", &store_kv);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("digest", [] { return std::string(SM70ATTN_STR(SM70ATTN_DIGEST)); }, "source digest this library was built from");
  m.def("init", [](py::object fetch, py::object fallback, py::object fallback_varlen, std::vector<int> head_dims, std::vector<int> group_sizes,
                   std::vector<int> query_rows, int64_t max_context, int min_cc) {
          Bounds b;
          for (int d : head_dims) {  // every head dim the manifest admits has its kernels
            for (int mb = 1; mb <= sm70attn::attn_max_row_blocks(d); ++mb)
              for (int vec : {8, 16})
                TORCH_CHECK(sm70attn::attn_switch(d, mb, vec, [](auto) {}),
                            msg("torch_sm70attn: the manifest admits head dim ", d, " but static_switch.h lists no "
                                "attention kernel for MB ", mb, " VEC ", vec));
            for (int vec : {8, 16})
              TORCH_CHECK(sm70attn::varlen_switch(d, sm70attn::varlen_row_blocks(), vec, [](auto) {}) &&
                              sm70attn::combine_varlen_switch(d, [](auto) {}),
                          msg("torch_sm70attn: no paged_attention_varlen kernels for head dim ", d));
            for (int splits : {1, 16, 64, sm70attn::attn_max_splits()})
              TORCH_CHECK(sm70attn::combine_switch(d, splits, [](auto) {}),
                          msg("torch_sm70attn: no combine kernel for head dim ", d));
          }
          for (int g : group_sizes) {
            TORCH_CHECK(g > 0 && g < 63, "init: group sizes in [1, 62]");
            b.group_mask |= 1ll << g;
          }
          for (int q : query_rows) {
            TORCH_CHECK(q > 0 && q < 63, "init: query rows in [1, 62]");
            b.rows_mask |= 1ll << q;
          }
          TORCH_CHECK(max_context > 0 && max_context <= INT_MAX / 2, "init: max_context out of range");
          b.head_dims = head_dims, b.max_context = max_context, b.min_cc = min_cc;
          g_bounds = b;
          if (!g_fetch) g_fetch = new py::object();
          if (!g_fallback) g_fallback = new py::object();
          if (!g_fallback_varlen) g_fallback_varlen = new py::object();
          *g_fetch = fetch, *g_fallback = fallback, *g_fallback_varlen = fallback_varlen;
        },
        "called once by torch_sm70attn.ops.load_cuda_kernels: the kernel loader, the reference route (called "
        "with the name of the rule a call failed) and the capability manifest's bounds", py::arg("fetch"),
        py::arg("fallback"), py::arg("fallback_varlen"), py::arg("head_dims"), py::arg("group_sizes"), py::arg("query_rows"),
        py::arg("max_context"), py::arg("min_cc"));
  m.def("set_validate", [](bool on) { g_validate.store(on); },
        "host-side checks of seq_lens and block_table in paged_attention (syncs; skipped while capturing)");
  m.def("set_plan_override", [](int num_sms, int sm_smem_bytes) {
          TORCH_CHECK_VALUE(num_sms >= 0 && sm_smem_bytes >= 0, "set_plan_override: values must be >= 0");
          g_plan_sms.store(num_sms), g_plan_sm_smem.store(sm_smem_bytes);
        },
        "benchmarks only: plan paged_attention for num_sms SMs holding at most as many CTAs as "
        "sm_smem_bytes of shared memory per SM would (0: the device's own)", pybind11::arg("num_sms") = 0,
        pybind11::arg("sm_smem_bytes") = 0);
  m.def("set_kernel_override", [](const std::string& kind) {
          int k = kind == "auto" ? -1 : -2;
          for (int i = 0; i < 3; ++i)
            if (kind == kKindNames[i]) k = i;
          TORCH_CHECK_VALUE(k != -2, msg("set_kernel_override: kind must be auto, wmma, rf-m8n8k4 or rf-m16n8k16, got '",
                            kind, "'"));
          if (k == sm70attn::ATTN_RF_M16N8K16) {  // (checked again at each call, on its device)
            const int device = c10::cuda::current_device();
            const int cc = device_info(device).cc;
            TORCH_CHECK_VALUE(cc >= 80, msg("set_kernel_override: 'rf-m16n8k16' needs SM80 or newer, the current "
                                            "device ", device, " is SM", cc));
          }
          g_kernel.store(k);
        },
        "tests and A/B runs only: the attention kernel of the calls where the register-fragment one applies "
        "(D = 256 with 17-48 rows per CTA): 'wmma', 'rf-m8n8k4', 'rf-m16n8k16' (SM80+) or 'auto' (the default, "
        "sm70attn::attn_default_kind: rf-m8n8k4 on a V100, SM 7.0, for CTAs of 17-32 rows from 64K tokens of "
        "capacity and of 33-48 rows from 128K, else wmma); set it while no other thread launches",
        pybind11::arg("kind"));
  m.def("plan", [](int64_t B, int64_t H_q, int64_t H_kv, int64_t Q, int64_t D, int64_t capacity, int vec, int device) {
          TORCH_CHECK_VALUE(B >= 1 && H_kv >= 1 && H_q >= H_kv && H_q % H_kv == 0 && in_mask(g_bounds.group_mask, H_q / H_kv) &&
                            in_mask(g_bounds.rows_mask, Q) && capacity >= 0 && capacity <= (int64_t)INT_MAX - 1024 &&
                            (vec == 8 || vec == 16) &&
                            std::find(g_bounds.head_dims.begin(), g_bounds.head_dims.end(), D) != g_bounds.head_dims.end(),
                            "plan: not a shape paged_attention takes to its kernels");
          const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
          const CallPlan c = plan_call(launcher(device), B, H_q, H_kv, Q, D, capacity, vec);
          pybind11::dict d;
          d["mb"] = c.plan.mb, d["row_groups"] = c.plan.row_groups, d["num_splits"] = c.plan.num_splits;
          d["num_sms"] = c.num_sms, d["ctas_per_sm"] = c.ctas_per_sm;
          d["kernel"] = kKindNames[c.kind];
          d["smem_bytes"] = c.smem_bytes > 0 ? c.smem_bytes : sm70attn::attn_smem_bytes(c.kind, (int)D, c.plan.mb, vec);
          return d;
        },
        "the launch plan paged_attention makes for a shape on a device (mb, row_groups, num_splits, num_sms, "
        "ctas_per_sm, kernel, smem_bytes)", pybind11::arg("B"), pybind11::arg("H_q"), pybind11::arg("H_kv"),
        pybind11::arg("Q"), pybind11::arg("D"), pybind11::arg("capacity"), pybind11::arg("vec") = 16,
        pybind11::arg("device") = 0);
}
