// Torch binding: CUDA implementations of the sm70attn ops whose schemas are defined in Python
// (torch_sm70attn), plus the hooks of the loader (init, digest, set_validate) and of tests and
// benchmarks. The only translation unit, and with its headers under binding/ the only code that
// includes torch. Built by the host C++ compiler alone (no nvcc): the kernels, torch-free headers
// under sm70attn/, are compiled at their first use by NVRTC (torch_sm70attn/nvrtc.py) and
// launched through the driver API (launch.h).
//
// Here: the registration of the ops and of the hooks. binding/host.h: messages, shared checks,
// the driver and the kernel loader; binding/route.h: the route of a call; binding/call_plan.h:
// the kernel kind and plan of a call; binding/ops.h: the ops' checks and launches.

// The JIT loader passes the digest as a bare token (-DSM70ATTN_DIGEST=abc123): quotes do not
// survive the build's command line.
#ifndef SM70ATTN_DIGEST
#define SM70ATTN_DIGEST unset
#endif
#define SM70ATTN_STR2(x) #x
#define SM70ATTN_STR(x) SM70ATTN_STR2(x)

#include "binding/call_plan.h"
#include "binding/host.h"
#include "binding/ops.h"
#include "binding/route.h"

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
                            msg("torch_sm70attn: the manifest admits head dim ", d, " but registry.h lists no "
                                "attention kernel for MB ", mb, " VEC ", vec));
            for (int vec : {8, 16})
              TORCH_CHECK(sm70attn::varlen_switch(d, sm70attn::varlen_row_blocks(), vec, [](auto) {}) &&
                              sm70attn::combine_varlen_switch(d, [](auto) {}),
                          msg("torch_sm70attn: no paged_attention_varlen kernels for head dim ", d));
            for (int vec : {8, 16})
              TORCH_CHECK(sm70attn::prefill_switch(d, vec, [](auto) {}),
                          msg("torch_sm70attn: no prefill kernel for head dim ", d));
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
          std::string kinds = "auto";
          for (int i = 0; i < kKinds; ++i) {
            if (kind == kKindNames[i]) k = i;
            kinds += std::string(i + 1 < kKinds ? ", " : " or ") + kKindNames[i];
          }
          TORCH_CHECK_VALUE(k != -2, msg("set_kernel_override: kind must be ", kinds, ", got '", kind, "'"));
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
  m.def("set_prefill_override", [](const std::string& kind) {
          const int k = kind == "auto"       ? kPrefillAuto
                        : kind == "off"      ? sm70attn::kNoPrefill
                        : kind == "m8n8k4"   ? sm70attn::PREFILL_M8N8K4
                        : kind == "m16n8k16" ? sm70attn::PREFILL_M16N8K16
                                             : -3;
          TORCH_CHECK_VALUE(k != -3, msg("set_prefill_override: kind must be auto, off, m8n8k4 or m16n8k16, got '", kind,
                                         "'"));
          if (k == sm70attn::PREFILL_M16N8K16) {  // (checked again at each call, on its device)
            const int device = c10::cuda::current_device();
            const int cc = device_info(device).cc;
            TORCH_CHECK_VALUE(cc >= 80, msg("set_prefill_override: 'm16n8k16' needs SM80 or newer, the current device ",
                                            device, " is SM", cc));
          }
          g_prefill.store(k);
        },
        "tests and A/B runs only: the prefill kernel paged_attention_varlen runs for requests of more than 16 "
        "tokens: 'm8n8k4', 'm16n8k16' (SM80+), 'off' (the varlen tile loop takes every request, as before the "
        "prefill kernel) or 'auto' (the default: m16n8k16 on SM80+, m8n8k4 below); set it while no other thread "
        "launches",
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
