"""CUDA graphs for the sm70attn backend where inductor cannot run (a V100: no Triton).

The Dynamo graph runs as it is, in place, as eager code does: no AOT functionalization. Through
AOT-eager, every `store_kv` became `auto_functionalized`, whose eager implementation clones the
whole paged cache before the write and copies it back after: two passes over the pool per layer
per step (measured on the H200: a 128K-token, batch-8 decode step of 4 layers went from 4.2 ms
eager to 10.2 ms compiled), and memory the size of the pool for each clone. Inductor removes
those clones (its reinplacing pass); nothing does on the AOT-eager path.

One CUDA graph is recorded per input signature (shapes, strides, int inputs, and the address of
each input used in place), after one eager warm-up call:
- used in place, at the address the graph was recorded with (another address records another
  graph): static inputs (parameters, buffers, `torch._dynamo.mark_static_address`), inputs the
  graph writes (the caches `store_kv` fills, lengths advanced in place: found in the graph by
  the passes' mutation analysis, and by the version counters of the warm-up call), and inputs
  of 64 MiB or more;
- every other tensor input is copied into a buffer the graph owns before each replay;
- outputs are cloned out of the graph's memory, except those that are in-place inputs.
The recordings of one compiled graph share one memory pool: they run one at a time. Calls
that record autograd (training) run eagerly, as does a signature whose capture failed.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from .fx_passes.common import mutated_roots, root

log = logging.getLogger("torch_sm70attn")

MAX_RECORDINGS = 64  # per compiled graph: shapes, or an in-place input that keeps moving
LARGE = 64 << 20  # bytes: an input this large is read in place, never copied per replay
DEVICE = "cuda"  # the device whose graphs are recorded (the CPU tests emulate one)


def written_inputs(graph: fx.Graph) -> set[int]:
    """Positions of the placeholders the graph writes, directly or through a view (the
    passes' own mutation analysis; a node that may write anything counts as writing every
    tensor it takes). The recorder adds the inputs its eager warm-up saw written."""
    pos = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    out = set()
    for node in graph.nodes:
        hit = mutated_roots(node)
        if hit is None:
            hit = [root(a) for a in node.all_input_nodes]
        out |= {pos[r] for r in hit if r in pos}
    return out


def static_inputs(graph: fx.Graph) -> set[int]:
    """Positions of the placeholders Dynamo marks static (parameters, buffers, tensors given to
    torch._dynamo.mark_static_address)."""
    return {
        i
        for i, n in enumerate(graph.find_nodes(op="placeholder"))
        if n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    }


class _Recording:
    def __init__(self, fn, args, in_place: list[bool], pool):
        self.copied = [
            i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not in_place[i]
        ]
        self.args = list(args)
        for i in self.copied:  # the graph's own input buffers, outside its pool
            self.args[i] = args[i].clone()
        self.graph, self.out = _capture(fn, self.args, pool)
        # outputs in the graph's memory are cloned at each replay; an output that is an
        # in-place input (or a view of one) is that input
        own = {
            a.untyped_storage().data_ptr()
            for i, a in enumerate(args)
            if i not in self.copied and isinstance(a, torch.Tensor)
        }
        self.cloned = [
            i
            for i, o in enumerate(self.out)
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in own
        ]
        # keep no reference to the in-place inputs (a cache dropped by its owner is freed)
        self.args = [a if i in self.copied else None for i, a in enumerate(self.args)]
        counters["sm70attn"]["cuda_graph_recordings"] += 1

    def replay(self, args):
        for i in self.copied:
            self.args[i].copy_(args[i])
        self.graph.replay()
        out = list(self.out)
        for i in self.cloned:
            out[i] = out[i].clone()
        return type(self.out)(out)


def _capture(fn, args, pool):
    """(CUDA graph of fn(*args), its outputs): recorded, not run."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


def _versions(args) -> list:
    """Each tensor input's version counter (None where there is none: inference tensors)."""
    return [
        a._version if isinstance(a, torch.Tensor) and not a.is_inference() else None for a in args
    ]


def graphed(gm: fx.GraphModule, example_inputs):
    """A callable that runs `gm` eagerly once per new input signature, then replays a CUDA
    graph of it (module docstring). Runs `gm` eagerly, counting a skip and saying why, when
    an input is not a CUDA tensor or an int, when autograd records (training), or when a
    capture fails."""
    fn = gm.forward
    why = _unsupported(example_inputs)
    if why is not None:
        return _eager(fn, why)
    graphs = _Graphs(fn, written_inputs(gm.graph) | static_inputs(gm.graph))

    def run(*args):
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            counters["sm70attn"]["cuda_graph_skips"] += 1  # autograd: no graph, as eager
            return fn(*args)
        return graphs.run(args)

    return run


def _unsupported(example_inputs) -> str | None:
    """Why no CUDA graph can run these inputs (the last input that says so), or None."""
    why = None
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type != DEVICE:
            why = f"an input is on {x.device}"
        elif not isinstance(x, (torch.Tensor, int, torch.SymInt)):
            why = f"an input is a {type(x).__name__}"
    return why


class _Graphs:
    """The CUDA graphs of one compiled graph `fn`, one per input signature (`key`): the first
    call of a signature runs eagerly (`warm_up`), the second records its graph (`record`),
    the later ones replay it. `written`: positions of the inputs used in place, found in the
    graph (written or static) and added to by the warm-up calls."""

    def __init__(self, fn, written: set[int]):
        self.fn, self.written = fn, written
        self.recordings: dict[tuple, _Recording] = {}
        self.warm: set[tuple] = set()
        self.eager_only: set[tuple] = set()  # signatures whose capture failed

    def run(self, args):
        """A call without autograd: replayed, eager or recorded, by its signature."""
        place = self.in_place(args)
        k = self.key(args, place)
        rec = self.recordings.get(k)
        if rec is not None:
            return rec.replay(args)
        if k in self.eager_only:
            return self.fn(*args)
        if k not in self.warm:  # first call of a signature: eager (lazy init, cuBLAS, ...)
            return self.warm_up(k, args)
        return self.record(k, args, place)

    def in_place(self, args) -> list[bool]:
        """Per input, whether the graph uses it at its address: written or static, or large."""
        return [
            isinstance(a, torch.Tensor)
            and (i in self.written or a.untyped_storage().nbytes() >= LARGE)
            for i, a in enumerate(args)
        ]

    @staticmethod
    def key(args, place) -> tuple:
        """The input signature: shapes, strides, dtypes, devices, the address of each input
        used in place, and the int inputs."""
        k = []
        for a, p in zip(args, place, strict=True):
            if isinstance(a, torch.Tensor):
                k.append(
                    (tuple(a.shape), a.stride(), a.dtype, a.device, a.data_ptr() if p else None)
                )
            else:
                k.append(a)
        return tuple(k)

    def warm_up(self, k: tuple, args):
        """The eager call of a new signature; the inputs it wrote are used in place from now
        on (writes the analysis missed)."""
        if len(self.warm) >= 4 * MAX_RECORDINGS:
            log.warning(
                "sm70attn backend: inputs at new addresses at every call: no CUDA graph "
                "(a cache or other written tensor must keep its address)"
            )
            self.warm.clear()
        self.warm.add(k)
        before = _versions(args)
        out = self.fn(*args)
        seen = {
            i
            for i, (v, a) in enumerate(zip(before, args, strict=True))
            if v is not None and a._version != v
        }
        self.written.update(seen)
        return out

    def record(self, k: tuple, args, place):
        """The second call of a signature: its graph recorded, then replayed; a failed capture
        runs eagerly, for this signature from now on."""
        if len(self.recordings) == MAX_RECORDINGS:
            log.warning(
                "sm70attn backend: %d CUDA graphs recorded for one compiled graph, dropped "
                "to record again: too many shapes (pad the batch: backend.pad_batch), or "
                "new caches (reuse one: cache.reset())",
                MAX_RECORDINGS,
            )
            self.recordings.clear()
        # all recordings of this graph share the memory pool of a live one
        pool = next(iter(self.recordings.values())).graph.pool() if self.recordings else None
        try:
            rec = self.recordings[k] = _Recording(self.fn, args, place, pool)
        except Exception as e:  # noqa: BLE001 - e.g. a host sync or copy inside the graph
            self.eager_only.add(k)
            counters["sm70attn"]["cuda_graph_skips"] += 1
            log.warning("sm70attn backend: CUDA graph capture failed (%s); runs eagerly", e)
            return self.fn(*args)
        return rec.replay(args)


def _eager(fn, why: str):
    counters["sm70attn"]["cuda_graph_skips"] += 1
    log.warning("sm70attn backend: no CUDA graph for this graph (%s); it runs eagerly", why)
    return fn
