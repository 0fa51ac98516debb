"""What the fused kernels are qualified for, and the bound a caller may rely on.

The capability manifest below is the only place that holds a context bound. Everything
else asks `MANIFEST` or `contract(...)`: the admission check, the CLI, the benchmarks and
(later) the graph builder. A deployment that serves less than the capability passes its
own capacity to `contract`, and the smaller of the two is the bound it captures graphs at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Capability:
    max_context: int  # longest seq_len the kernels are qualified for, in tokens
    head_dims: tuple[int, ...]
    group_sizes: tuple[int, ...]  # H_q / H_kv
    query_rows: tuple[int, ...]  # Q: 1 for decode, up to 16 for speculative verification
    query_dtypes: tuple[torch.dtype, ...]
    cache_dtypes: tuple[torch.dtype, ...]
    min_compute_capability: tuple[int, int]

    def as_dict(self) -> dict:
        def span(xs):
            return f"{xs[0]}-{xs[-1]}" if xs == tuple(range(xs[0], xs[-1] + 1)) else list(xs)

        return {
            "max_context": self.max_context,
            "head_dims": list(self.head_dims),
            "group_sizes": span(self.group_sizes),
            "query_rows": span(self.query_rows),
            "query_dtypes": [str(d).removeprefix("torch.") for d in self.query_dtypes],
            "cache_dtypes": [str(d).removeprefix("torch.") for d in self.cache_dtypes],
            "min_compute_capability": "sm_{}{}".format(*self.min_compute_capability),
        }


MANIFEST = Capability(
    max_context=262144,
    head_dims=(64, 128, 256),
    group_sizes=tuple(range(1, 9)),
    query_rows=tuple(range(1, 17)),
    query_dtypes=(torch.float16,),
    cache_dtypes=(torch.float8_e4m3fn,),
    min_compute_capability=(7, 0),
)


def contract(served_capacity: int | None = None, manifest: Capability = MANIFEST) -> int:
    """The context bound to capture and admit at: min(capability, served capacity)."""
    if served_capacity is None:
        return manifest.max_context
    if served_capacity < 0:
        raise ValueError(f"served_capacity must be >= 0, got {served_capacity}")
    return min(manifest.max_context, served_capacity)


def admitted_capacity(page_size: int, served_capacity: int | None = None) -> int:
    """Largest block-table capacity (max_pages * page_size) admitted for this page size.

    A request of `contract()` tokens needs ceil(contract / page_size) whole pages, so the
    table may address up to one partial page more than the contract (e.g. 80 pages of 3296
    for 262144 tokens); seq_lens themselves must stay within the contract.
    """
    return math.ceil(contract(served_capacity) / page_size) * page_size
