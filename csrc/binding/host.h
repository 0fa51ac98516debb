// The binding's host side shared by its parts (csrc/binding/): error messages, the argument
// checks the ops share, the driver API (dlopen'd), the kernel loader torch_sm70attn hands in at
// init, each device's properties, and the hooks' settings. The binding is one translation unit
// (csrc/binding.cpp includes these headers in order); everything here has internal linkage.
#pragma once

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

#include "../launch.h"

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
// Test and A/B hook (set_prefill_override): the prefill kernel of paged_attention_varlen (its
// family, or sm70attn::kNoPrefill: the tile loop takes every request); kPrefillAuto: the default.
constexpr int kPrefillAuto = -2;
std::atomic<int> g_prefill{kPrefillAuto};

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

int device_attribute(int device, CUdevice_attribute a) {
  int v = 0;
  check_cu(driver().attribute(&v, a, device), "cuDeviceGetAttribute");
  return v;
}

}  // namespace
