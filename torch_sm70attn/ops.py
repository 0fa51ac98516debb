"""The sm70attn operators: each schema defined once, its fake kernel right under it, then
its CPU kernel. CUDA kernels are registered by the compiled binding (csrc/binding.cpp) once
it is loaded; see routes.py for how a call reaches them.
"""

from __future__ import annotations

import torch

from . import checks, reference, routes

lib = torch.library.Library("sm70attn", "DEF")  # noqa: TOR901 (schemas live here, once)


def _check_values(t: torch.Tensor) -> bool:
    """Value checks always on the CPU; on a GPU only in validate mode, never while capturing."""
    if t.device.type == "cpu":
        return True
    return routes.validate_mode() and not torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------
lib.define(
    "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
    "Tensor seq_lens, float scale, Tensor k_scale, Tensor v_scale) -> Tensor"
)


@torch.library.register_fake("sm70attn::paged_attention", lib=lib)
def _paged_attention_fake(
    query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale
):
    checks.check_paged_attention(
        query, key_cache, value_cache, block_table, seq_lens, k_scale, v_scale
    )
    return query.new_empty(query.shape)  # contiguous, like every real kernel's output


def paged_attention_ref(
    query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale
):
    """paged_attention's reference route, checks included: the CPU kernel, and what a CUDA call
    runs that the binding refused or that TORCH_SM70ATTN_DISABLE kept from it. cuda_fallback and
    the public function look it up by this name at each call: a test counts those calls by
    replacing it."""
    _, _, _, _, P, page_size, _ = checks.check_paged_attention(
        query, key_cache, value_cache, block_table, seq_lens, k_scale, v_scale
    )
    if _check_values(query):
        checks.check_paged_attention_values(block_table, seq_lens, P, page_size)
    return reference.paged_attention(
        query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale
    )


lib.impl("paged_attention", paged_attention_ref, "CPU")

# ---------------------------------------------------------------------------------------
lib.define(
    "paged_attention_varlen(Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor block_table, Tensor query_start_loc, Tensor seq_lens, float scale, Tensor k_scale, "
    "Tensor v_scale) -> Tensor"
)


@torch.library.register_fake("sm70attn::paged_attention_varlen", lib=lib)
def _paged_attention_varlen_fake(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale, v_scale
):
    checks.check_paged_attention_varlen(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale, v_scale
    )
    return query.new_empty(query.shape)


def _paged_attention_varlen_ref(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale, v_scale
):
    T, _, _, _, P, page_size, _ = checks.check_paged_attention_varlen(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale, v_scale
    )
    if _check_values(query):
        checks.check_query_start_loc_values(query_start_loc, T)
        checks.check_paged_attention_values(block_table, seq_lens, P, page_size)
    return reference.paged_attention_varlen(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale,
        v_scale,
    )  # fmt: skip


lib.impl("paged_attention_varlen", _paged_attention_varlen_ref, "CPU")

# ---------------------------------------------------------------------------------------
lib.define(
    "store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, Tensor k_scale, Tensor v_scale) -> ()"
)


@torch.library.register_fake("sm70attn::store_kv", lib=lib)
def _store_kv_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    checks.check_store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _store_kv_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    _, _, _, P, page_size = checks.check_store_kv(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
    )
    if _check_values(key):
        checks.check_store_kv_values(slot_mapping, P * page_size)
    reference.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


lib.impl("store_kv", _store_kv_ref, "CPU")

# ---------------------------------------------------------------------------------------
lib.define("verifier_mask(Tensor seq_lens, SymInt q_rows, SymInt kv_len) -> Tensor")


@torch.library.register_fake("sm70attn::verifier_mask", lib=lib)
def _verifier_mask_fake(seq_lens, q_rows, kv_len):
    checks.check_verifier_mask(seq_lens, q_rows, kv_len)
    return seq_lens.new_empty((seq_lens.shape[0], 1, q_rows, kv_len), dtype=torch.bool)


def _verifier_mask_any(seq_lens, q_rows, kv_len):
    checks.check_verifier_mask(seq_lens, q_rows, kv_len)
    return reference.verifier_mask(seq_lens, q_rows, kv_len)


# Plain tensor ops: the same code is right on every device.
lib.impl("verifier_mask", _verifier_mask_any, "CompositeExplicitAutograd")

# CUDA: the compiled binding (csrc/binding.cpp) registers the CUDA implementations of both ops
# when it is loaded. It is built on first use, so until then the CUDA key holds a loader: the
# first CUDA call drops the loader's registration, builds and loads the binding, and dispatches
# again, straight to C++ (whose kernels NVRTC compiles at their own first use). With
# TORCH_SM70ATTN_DISABLE=1 at that first call nothing is built and CUDA calls run the reference
# (right, slow, not capturable).
_REFERENCE = {
    "paged_attention": paged_attention_ref,
    "paged_attention_varlen": _paged_attention_varlen_ref,
    "store_kv": _store_kv_ref,
}
_loader: torch.library.Library | None = None


def _first_cuda_call(name):
    def impl(*args):
        if routes.disabled():
            return _REFERENCE[name](*args)
        load_cuda_kernels()
        return getattr(torch.ops.sm70attn, name).default(*args)

    return impl


def _install_loader() -> None:
    global _loader
    _loader = torch.library.Library("sm70attn", "IMPL")  # noqa: TOR901
    for name in _REFERENCE:
        _loader.impl(name, _first_cuda_call(name), "CUDA")


def cuda_fallback(
    query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale, rule
):
    """The reference route of a CUDA call the binding refused: `rule` names the first of
    routes.RULES it failed (the binding decides, by the manifest handed over at load), whose
    reason is warned once per reason, as for the public function's calls."""
    call = routes.Call(query, key_cache, value_cache, block_table)
    routes.warn_fallback(routes.binding_reason(rule, call))
    return paged_attention_ref(
        query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale
    )


def cuda_fallback_varlen(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale,
    v_scale, rule,
):  # fmt: skip
    """cuda_fallback for paged_attention_varlen (its rules read the query as [T, H_q, 1, D])."""
    call = routes.Call(query.unsqueeze(2), key_cache, value_cache, block_table)
    routes.warn_fallback(routes.binding_reason(rule, call))
    return _paged_attention_varlen_ref(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale,
        v_scale,
    )  # fmt: skip


def load_cuda_kernels():
    """Build (once) and load the CUDA binding; returns it. Raises if it cannot be built, or if
    this torch has no code for the GPU (torch_sm70attn.nvrtc.check_torch_arch)."""
    global _loader
    from . import _jit, nvrtc
    from .manifest import MANIFEST

    if _loader is None:
        return _jit.load()  # cached
    if torch.cuda.is_available():  # (`build` loads it on a machine without a GPU too)
        nvrtc.check_torch_arch(torch.cuda.current_device())
    _loader._destroy()
    _loader = None
    try:
        mod = _jit.load()
        mod.init(
            nvrtc.fetch,
            cuda_fallback,
            cuda_fallback_varlen,
            head_dims=list(MANIFEST.head_dims),
            group_sizes=list(MANIFEST.group_sizes),
            query_rows=list(MANIFEST.query_rows),
            max_context=MANIFEST.max_context,
            min_cc=10 * MANIFEST.min_compute_capability[0] + MANIFEST.min_compute_capability[1],
        )
    except Exception:
        _install_loader()
        raise
    mod.set_validate(routes.validate_mode())
    return mod


_install_loader()
