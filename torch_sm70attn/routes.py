"""Which implementation serves a call: the fused CUDA kernel or the reference.

`admit` decides from metadata alone (real or fake tensors), so the FX pass can ask the same
question at compile time that the eager wrapper asks at run time.
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


def shape_refusal(query, key_cache, block_table=None, served_capacity=None) -> str | None:
    """Why the manifest does not admit these shapes/dtypes/strides, or None."""
    if query.dtype not in MANIFEST.query_dtypes:
        return f"query dtype {query.dtype} not in {MANIFEST.query_dtypes}"
    if key_cache.dtype not in MANIFEST.cache_dtypes:
        return f"cache dtype {key_cache.dtype} not in {MANIFEST.cache_dtypes}"
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
    offset = 0 if torch.compiler.is_compiling() else key_cache.storage_offset()
    if offset % 8 or any(s % 8 for s in key_cache.stride()[:-1]):
        return f"cache strides {key_cache.stride()} / offset not 8-byte aligned"
    return None


def admit(query, key_cache, block_table=None, *, served_capacity=None) -> Admission:
    """Route for a paged_attention call with these tensors (real or fake) and the reason."""
    reason = _device_refusal(query) or shape_refusal(query, key_cache, block_table, served_capacity)
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
