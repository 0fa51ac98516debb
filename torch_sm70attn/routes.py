"""Which implementation serves a call: the fused CUDA kernels or the reference.

RULES, below, is the rule: the conditions a call must meet to take the kernels, in the order they
are checked; the first it fails is its route's reason. Each is applied at run time in one place
(Rule.by): a dtype outside the manifest is the op's TypeError on every device; DISABLE and the
device are settled before the binding (the public function reads DISABLE on every call, the CUDA
loader at the first call; a CPU tensor never reaches the binding); the binding's rules are the
binding's alone, by the manifest handed to it at load (ops.load_cuda_kernels): a call it refuses
comes back to ops.cuda_fallback with the name of the first rule it failed, and the warning gives
that rule's reason as worded here. `admit` evaluates the same table from metadata alone (real or
fake tensors), so the FX pass and users can ask at compile time what the binding decides at run
time. tests/test_routes.py checks that the binding names its rules in RULES' order and each rule
on the CPU; tests/test_cuda.py that the binding's route and reason are admit's, rule by rule.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
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


def _capability(index: int | None) -> tuple[int, int]:
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


class Call(NamedTuple):
    """What the rules read of a paged_attention call: metadata only (real or fake tensors)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor | None = None  # None: its rules are skipped
    block_table: torch.Tensor | None = None  # None: the capacity rule is skipped
    served_capacity: int | None = None


class Rule(NamedTuple):
    name: str  # what the binding hands back when it refuses a call by this rule
    tensor: str  # the argument it reads ("" for the process's environment)
    by: str  # who applies it at run time: "op" (TypeError), "python" (before the binding), "binding"
    refusal: Callable[[Call], str | None]  # the reason a call fails it, or None


def _dtype(name: str, allowed: tuple[torch.dtype, ...]) -> Callable[[Call], str | None]:
    def refusal(c: Call) -> str | None:
        t = getattr(c, name)
        if t is not None and t.dtype not in allowed:
            return f"{name} dtype {t.dtype} not in {allowed}"
        return None

    return refusal


def _disabled(c: Call) -> str | None:
    return "TORCH_SM70ATTN_DISABLE=1" if disabled() else None


def _device(c: Call) -> str | None:
    if c.query.device.type != "cuda":
        return f"device is {c.query.device.type}, the fused kernels are CUDA-only"
    return None


def _compute_capability(c: Call) -> str | None:
    cc = _capability(c.query.device.index)
    if cc < MANIFEST.min_compute_capability:
        return f"compute capability sm_{cc[0]}{cc[1]} < sm_70"
    return None


def _head_dim(c: Call) -> str | None:
    D = c.query.shape[3]
    return None if D in MANIFEST.head_dims else f"head dim {D} not in {MANIFEST.head_dims}"


def _group_size(c: Call) -> str | None:
    H_q, H_kv = c.query.shape[1], c.key_cache.shape[2]
    if H_kv == 0 or H_q % H_kv or H_q // H_kv not in MANIFEST.group_sizes:
        return f"group size H_q/H_kv = {H_q}/{H_kv} not in {MANIFEST.group_sizes}"
    return None


def _query_rows(c: Call) -> str | None:
    # Bounds, not membership: under torch.compile's dynamic shapes Q and the table width are
    # symbolic, and these comparisons become range guards instead of one graph per value.
    Q, rows = c.query.shape[2], MANIFEST.query_rows  # a contiguous range
    if Q < rows[0] or Q > rows[-1]:
        return f"query rows {Q} not in {rows[0]}-{rows[-1]}"
    return None


def _table_capacity(c: Call) -> str | None:
    if c.block_table is None:
        return None
    page_size = c.key_cache.shape[1]
    capacity = c.block_table.shape[1] * page_size
    bound = admitted_capacity(int(page_size), c.served_capacity)
    if capacity > bound:
        return f"block table capacity {capacity} exceeds the contract ({bound})"
    return None


def _aligned(name: str) -> Callable[[Call], str | None]:
    # The kernels load K/V rows 8 bytes at a time at least (16 where strides allow). A stride
    # only matters along a dimension of size > 1. The binding reads the data pointer; this,
    # the storage offset, except inside a traced function (the attention of a compiled model),
    # where Dynamo cannot trace storage_offset() and the binding alone sees it.
    def refusal(c: Call) -> str | None:
        t = getattr(c, name)
        if t is None:
            return None
        offset = 0 if torch.compiler.is_compiling() else t.storage_offset()
        strides = zip(t.stride()[:-1], t.shape[:-1])  # noqa: B905
        if offset % 8 or any(s % 8 for s, n in strides if n > 1):
            return f"{name} strides {t.stride()} / offset {offset} not 8-byte aligned"
        return None

    return refusal


RULES: tuple[Rule, ...] = (
    Rule("query dtype", "query", "op", _dtype("query", MANIFEST.query_dtypes)),
    Rule("key_cache dtype", "key_cache", "op", _dtype("key_cache", MANIFEST.cache_dtypes)),
    Rule("value_cache dtype", "value_cache", "op", _dtype("value_cache", MANIFEST.cache_dtypes)),
    Rule("TORCH_SM70ATTN_DISABLE", "", "python", _disabled),
    Rule("device", "query", "python", _device),
    Rule("compute capability", "query", "binding", _compute_capability),
    Rule("head dim", "query", "binding", _head_dim),
    Rule("group size", "query", "binding", _group_size),
    Rule("query rows", "query", "binding", _query_rows),
    Rule("table capacity", "block_table", "binding", _table_capacity),
    Rule("key_cache alignment", "key_cache", "binding", _aligned("key_cache")),
    Rule("value_cache alignment", "value_cache", "binding", _aligned("value_cache")),
)
_DEVICE_RULES = ("TORCH_SM70ATTN_DISABLE", "device", "compute capability")
_SHAPE_RULES = tuple(r for r in RULES if r.name not in _DEVICE_RULES)
_DTYPE_RULES = tuple(r for r in RULES if r.by == "op")
_BY_NAME = {r.name: r for r in RULES}


def first_refusal(call: Call, rules: tuple[Rule, ...] = RULES) -> tuple[Rule, str] | None:
    """The first of `rules` this call fails and its reason, or None."""
    for rule in rules:
        why = rule.refusal(call)
        if why:
            return rule, why
    return None


def dtype_refusal(query, key_cache, value_cache=None) -> str | None:
    """Why the op takes these dtypes on no route (it raises TypeError), or None."""
    hit = first_refusal(Call(query, key_cache, value_cache), _DTYPE_RULES)
    return hit and hit[1]


def shape_refusal(
    query, key_cache, block_table=None, served_capacity=None, value_cache=None
) -> str | None:
    """Why the manifest does not admit these shapes/dtypes/strides (RULES but the device's), or
    None."""
    call = Call(query, key_cache, value_cache, block_table, served_capacity)
    hit = first_refusal(call, _SHAPE_RULES)
    return hit and hit[1]


def admit(
    query, key_cache, block_table=None, *, served_capacity=None, value_cache=None
) -> Admission:
    """Route for a paged_attention call with these tensors (real or fake) and the reason: the
    first of RULES the call fails (value_cache, block_table: their rules are checked where they
    are given). The rules, in order:
    """
    hit = first_refusal(Call(query, key_cache, value_cache, block_table, served_capacity))
    if hit is None:
        return Admission(CUDA, "admitted")
    rule, why = hit
    if rule.by == "op":
        return Admission(UNSUPPORTED, why + ": paged_attention raises TypeError")
    return Admission(REFERENCE, why)


if admit.__doc__:  # (None under python -OO)
    admit.__doc__ += "".join(
        f"\n    - {r.name} ({r.tensor or 'environment'}; at run time: {r.by})" for r in RULES
    )


def binding_reason(name: str, call: Call) -> str:
    """The reason of a call the binding refused by rule `name`, the first it failed, in RULES'
    words (the binding decides the route; this only words it)."""
    rule = _BY_NAME.get(name)
    why = rule.refusal(call) if rule is not None else None
    return why or f"{name} (the binding's check; admit, which sees only metadata, passes this call)"


# The reasons warn_fallback has warned in this process, each once. Public for the tests, which
# read it and give it an empty set to see a reason warned again.
warned: set[str] = set()


def warn_fallback(reason: str) -> None:
    """One warning per distinct reason a CUDA call takes the reference route."""
    log.debug("paged_attention -> reference: %s", reason)
    if reason not in warned and not disabled():
        warned.add(reason)
        warnings.warn(
            f"torch_sm70attn: paged_attention takes the slow reference route: {reason}",
            stacklevel=3,
        )
