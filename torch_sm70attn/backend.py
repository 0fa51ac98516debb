"""The torch.compile backend "sm70attn": rewrite, then compile.

    model = torch.compile(model, backend="sm70attn")                          # inductor
    model = torch.compile(model, backend="sm70attn", mode="reduce-overhead")  # + CUDA graphs

The FX passes (fx_passes/) rewrite SDPA over a paged E4M3 cache into
sm70attn.paged_attention and the quantized cache write into sm70attn.store_kv. The graph then
goes to inductor with the options `mode` implies plus `options`. Where Triton cannot target
the GPU (compute capability below 7.5: V100 with current Triton), the rewritten graph runs as
it is (inner "eager"), and for mode="reduce-overhead" is replayed as CUDA graphs
(`cudagraphs.graphed`, inner "cudagraphs"; options={"inner": "cudagraphs"} asks for it
anywhere), so reduce-overhead still means CUDA graphs. Neither goes through AOT-eager, whose
functionalization copies the whole cache at every store_kv (`cudagraphs.py`); "aot_eager"
stays selectable for debugging. The backend is registered through the
`torch_dynamo_backends` entry point of this package.

For users of backend="inductor", `install_inductor_pass()` installs the same rewrite as
inductor's pre-grad custom pass.

CUDA graphs are recorded one per input shape and do not pad: `pad_batch` pads a batch to
bucket sizes (padding requests have seq_len 0 and output 0).
"""

from __future__ import annotations

import bisect
import logging
from pathlib import Path

import torch
import torch.fx as fx

from . import cudagraphs
from .fx_passes import paged_attention as _attention_pass
from .fx_passes import store_kv as _store_pass

log = logging.getLogger("torch_sm70attn")
INNERS = ("inductor", "cudagraphs", "aot_eager", "eager")


def rewrite(graph: fx.Graph) -> tuple[int, int]:
    """Both rewrites on a Dynamo graph; returns (attention rewrites, store rewrites)."""
    n_attn = _attention_pass.rewrite_graph(graph)
    n_store = _store_pass.rewrite_graph(graph)
    if n_attn or n_store:
        graph.lint()
    return n_attn, n_store


def _device(example_inputs) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            return x.device
    return torch.device("cpu")


def triton_can_target(device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # inductor's CPU code generation is C++, not Triton
    from torch.utils._triton import has_triton

    return torch.cuda.get_device_capability(device) >= (7, 5) and has_triton()


def sm70attn_backend(gm: fx.GraphModule, example_inputs, mode=None, options=None):
    options = dict(options or {})
    inner = options.pop("inner", None)
    if inner is not None and inner not in INNERS:
        raise ValueError(
            f"sm70attn backend: options['inner'] must be one of {INNERS}, got {inner!r}"
        )
    n_attn, n_store = rewrite(gm.graph)
    gm.recompile()
    device = _device(example_inputs)
    if inner is None:
        if triton_can_target(device):
            inner = "inductor"
        elif mode in ("reduce-overhead", "max-autotune"):
            inner = "cudagraphs"
        else:
            inner = "eager"
    log.debug(
        "sm70attn backend: %d attention and %d store rewrites; inner compiler %s (mode %s)",
        n_attn,
        n_store,
        inner,
        mode,
    )
    if inner == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = dict(list_mode_options(mode)) if mode else {}
        patches.update(options)
        return compile_fx(gm, example_inputs, config_patches=patches)
    if options:
        raise ValueError(f"sm70attn backend: options {sorted(options)} need inner='inductor'")
    if inner == "cudagraphs":  # the graph in place, as CUDA graphs (no AOT: cudagraphs.py)
        return cudagraphs.graphed(gm, example_inputs)
    if inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    return gm.forward


# --- for users of backend="inductor" --------------------------------------------------------
def _pass_files() -> tuple[str, ...]:
    root = Path(_attention_pass.__file__).parent
    return tuple(str(p) for p in sorted(root.glob("*.py")))


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # pragma: no cover - torch without custom graph passes
    CustomGraphPass, get_hash_for_files = object, None


class RewritePass(CustomGraphPass):
    """The sm70attn rewrites as an inductor custom graph pass (pre-grad)."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite(graph)

    def uuid(self):
        return get_hash_for_files(_pass_files())


def install_inductor_pass() -> None:
    """Run the sm70attn rewrites as inductor's pre-grad custom pass (backend="inductor")."""
    torch._inductor.config.pre_grad_custom_pass = RewritePass()


# --- cudagraph-tree buckets -----------------------------------------------------------------
def bucket(n: int, buckets=(1, 2, 4, 8, 16, 32)) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"batch {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def pad_batch(query, block_table, seq_lens, buckets=(1, 2, 4, 8, 16, 32), width=None):
    """Pad query [B, ...], block_table [B, W] and seq_lens [B] to the bucket of B, and the
    table to `width` columns if given.

    Padding requests have seq_len 0 (the op outputs 0 for them) and a table of page 0; padding
    columns hold page 0 and are never read (the op reads only the pages a request reaches).
    With mode="reduce-overhead" each (bucket, width) is one recorded CUDA graph, so a fixed
    width (the most pages a request may hold) bounds the recordings to the buckets.
    Returns (query, block_table, seq_lens, B); slice the output with [:B].
    """
    B, W = block_table.shape
    if width is not None and width < W:
        raise ValueError(f"pad_batch: width {width} < the block table's {W} columns")
    if width is not None and width > W:
        block_table = torch.cat([block_table, block_table.new_zeros((B, width - W))], dim=1)
    n = bucket(B, buckets) - B
    if n == 0:
        return query, block_table, seq_lens, B
    query = torch.cat([query, query.new_zeros((n, *query.shape[1:]))])
    block_table = torch.cat([block_table, block_table.new_zeros((n, block_table.shape[1]))])
    seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(n)])
    return query, block_table, seq_lens, B
