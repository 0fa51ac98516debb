"""Which implementation serves a call: the fused CUDA kernel or the reference.

`admit` decides from metadata alone (real or fake tensors), so the FX pass can ask at compile
time what a call meets at run time. At run time the binding decides, for the public function and
the raw op alike, by the same manifest (handed to it at load: ops.load_cuda_kernels) and the same
alignment rule; a call it refuses comes back to `admit` for the reason (ops.cuda_fallback), and
tests/test_cuda.py checks that the two agree.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import NamedTuple

import torch

from .manifest import MANIFEST, admitted_capacity

log = logging.getLogger("torch_sm70attn")

CUDA = "cuda"  # the fused kernels of csrc/
REFERENCE = "reference"  # reference.py: plain PyTorch, any device, not graph-capturable on a GPU
UNSUPPORTED = "unsupported"  # no route: the op rejects these inputs (a TypeError names why)


class Admission(NamedTuple):
    route: str
    reason: str  # why this route: the first condition that failed, or "admitted"


def disabled() -> bool:
    return os.environ.get("TORCH_SM70ATTN_DISABLE", "0") not in ("", "0")


def validate_mode() -> bool:
    return os.environ.get("TORCH_SM70ATTN_VALIDATE", "0") not in ("", "0")


_CAPABILITY: dict[int, tuple[int, int]] = {}  # a plain dict: Dynamo traces it without a warning


def _capability(index: int) -> tuple[int, int]:
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def _device_refusal(query) -> str | None:
    if disabled():
        return "TORCH_SM70ATTN_DISABLE=1"
    if query.device.type != "cuda":
        return f"device is {query.device.type}, the fused kernels are CUDA-only"
    index = query.device.index
    cc = _capability(torch.cuda.current_device() if index is None else index)
    if cc < MANIFEST.min_compute_capability:
        return f"compute capability sm_{cc[0]}{cc[1]} < sm_70"
    return None


def dtype_refusal(query, key_cache) -> str | None:
    """Why the op takes these dtypes on no route (it raises TypeError), or None."""
    if query.dtype not in MANIFEST.query_dtypes:
        return f"query dtype {query.dtype} not in {MANIFEST.query_dtypes}"
    if key_cache.dtype not in MANIFEST.cache_dtypes:
        return f"cache dtype {key_cache.dtype} not in {MANIFEST.cache_dtypes}"
    return None


def shape_refusal(
    query, key_cache, block_table=None, served_capacity=None, value_cache=None
) -> str | None:
    """Why the manifest does not admit these shapes/dtypes/strides, or None."""
    return dtype_refusal(query, key_cache) or _layout_refusal(
        query, key_cache, block_table, served_capacity, value_cache
    )


def _layout_refusal(query, key_cache, block_table, served_capacity, value_cache=None) -> str | None:
    """shape_refusal past the dtypes: head dim, group size, rows, capacity, alignment."""
    _, H_q, Q, D = query.shape
    _, page_size, H_kv, _ = key_cache.shape
    if D not in MANIFEST.head_dims:
        return f"head dim {D} not in {MANIFEST.head_dims}"
    if H_kv == 0 or H_q % H_kv or H_q // H_kv not in MANIFEST.group_sizes:
        return f"group size H_q/H_kv = {H_q}/{H_kv} not in {MANIFEST.group_sizes}"
    # Bounds, not membership: under torch.compile's dynamic shapes Q and the table width are
    # symbolic, and these comparisons become range guards instead of one graph per value.
    rows = MANIFEST.query_rows  # a contiguous range
    if Q < rows[0] or Q > rows[-1]:
        return f"query rows {Q} not in {rows[0]}-{rows[-1]}"
    if block_table is not None:
        capacity = block_table.shape[1] * page_size
        bound = admitted_capacity(int(page_size), served_capacity)
        if capacity > bound:
            return f"block table capacity {capacity} exceeds the contract ({bound})"
    # The kernels load K/V rows 8 bytes at a time at least (16 where strides allow). Dynamo
    # cannot trace storage_offset(): inside a traced function (the attention of a compiled
    # model) the offset is left to the CUDA kernel, which raises on a misaligned cache.
    # A stride only matters along a dimension of size > 1 (as the binding reads it). The binding
    # checks both caches: so does this, where the caller gives value_cache.
    caches = [("cache", key_cache)] if value_cache is None else [
        ("key_cache", key_cache), ("value_cache", value_cache)
    ]  # fmt: skip
    for name, cache in caches:
        offset = 0 if torch.compiler.is_compiling() else cache.storage_offset()
        strides = zip(cache.stride()[:-1], cache.shape[:-1])  # noqa: B905
        if offset % 8 or any(s % 8 for s, n in strides if n > 1):
            return f"{name} strides {cache.stride()} / offset not 8-byte aligned"
    return None


def admit(
    query, key_cache, block_table=None, *, served_capacity=None, value_cache=None
) -> Admission:
    """Route for a paged_attention call with these tensors (real or fake) and the reason
    (value_cache: its alignment is checked too, as the binding does)."""
    why = dtype_refusal(query, key_cache)
    if why:
        return Admission(UNSUPPORTED, why + ": paged_attention raises TypeError")
    reason = _device_refusal(query) or _layout_refusal(
        query, key_cache, block_table, served_capacity, value_cache
    )
    if reason is None:
        return Admission(CUDA, "admitted")
    return Admission(REFERENCE, reason)


_warned: set[str] = set()


def warn_fallback(reason: str) -> None:
    """One warning per distinct reason a CUDA call takes the reference route."""
    log.debug("paged_attention -> reference: %s", reason)
    if reason not in _warned and not disabled():
        _warned.add(reason)
        warnings.warn(
            f"torch_sm70attn: paged_attention takes the slow reference route: {reason}",
            stacklevel=3,
        )
