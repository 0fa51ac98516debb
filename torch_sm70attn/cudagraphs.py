"""CUDA graphs for the sm70attn backend where inductor cannot run (a V100: no Triton).

The Dynamo graph runs as it is, in place, as eager code does: no AOT functionalization. Through
AOT-eager, every `store_kv` became `auto_functionalized`, whose eager implementation clones the
whole paged cache before the write and copies it back after: two passes over the pool per layer
per step (measured on the H200: a 128K-token, batch-8 decode step of 4 layers went from 4.2 ms
eager to 10.2 ms compiled), and an out-of-memory error once the pool is most of the GPU.
Inductor removes those clones (its reinplacing pass); nothing does on the AOT-eager path.

One CUDA graph is recorded per input signature (shapes, strides, int inputs, and the address of
each input the graph writes or that is static), after one eager warm-up call:
- static inputs (parameters, buffers, `torch._dynamo.mark_static_address`) and inputs the graph
  writes (the caches `store_kv` fills, lengths advanced in place) are used in place, at the
  address the graph was recorded with (another address records another graph);
- every other tensor input is copied into a buffer the graph owns before each replay;
- outputs are cloned out of the graph's memory, except those that alias an input.
The recordings of one compiled graph share one memory pool: they run one at a time.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

log = logging.getLogger("torch_sm70attn")

# Tensor methods and functions that return a view of their first argument: a write through the
# view is a write to the argument.
_VIEWS = {
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "unsqueeze",
    "squeeze",
    "transpose",
    "permute",
    "expand",
    "select",
    "narrow",
    "__getitem__",
    "getitem",
    "as_strided",
    "view_as",
    "unbind",
    "split",
    "chunk",
    "t",
    "T",
    "movedim",
    "diagonal",
    "detach",
    "alias",
}
MAX_RECORDINGS = 64  # per compiled graph: shapes, or an in-place input that keeps moving


def _name(target) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", "") or str(target)
    return name.split(".")[-1]


def _written(node: fx.Node) -> list[fx.Node]:
    """The tensor arguments `node` writes in place."""
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        out = []
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                out += [v] if isinstance(v, fx.Node) else []
        return out
    out = node.kwargs.get("out")  # torch.add(a, b, out=c)
    if isinstance(out, fx.Node):
        return [out]
    if node.op in ("call_method", "call_function"):
        name = _name(t)
        in_place = name.endswith("_") and not name.endswith("__")
        if (in_place or name == "setitem") and node.args and isinstance(node.args[0], fx.Node):
            return [node.args[0]]
    return []


def _root(node: fx.Node) -> fx.Node:
    """The placeholder (or other node) that `node` is a view of."""
    while node.op in ("call_method", "call_function") and _name(node.target) in _VIEWS:
        if not (node.args and isinstance(node.args[0], fx.Node)):
            break
        node = node.args[0]
    return node


def written_inputs(graph: fx.Graph) -> set[int]:
    """Positions of the placeholders the graph writes (directly or through a view)."""
    pos = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    out = set()
    for node in graph.nodes:
        for w in _written(node):
            r = _root(w)
            if r in pos:
                out.add(pos[r])
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
    def __init__(self, fn, args, in_place: set[int], pool):
        self.copied = [
            i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in in_place
        ]
        self.args = list(args)
        for i in self.copied:  # the graph's own input buffers, outside its pool
            self.args[i] = args[i].clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*self.args)
        # keep no reference to the in-place inputs (a cache dropped by its owner is freed)
        self.args = [a if i in self.copied else None for i, a in enumerate(self.args)]
        counters["sm70attn"]["cuda_graph_recordings"] += 1

    def replay(self, args):
        for i in self.copied:
            self.args[i].copy_(args[i])
        self.graph.replay()
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}

        def out(o):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                return o.clone()
            return o

        return type(self.out)(out(o) for o in self.out)


def graphed(gm: fx.GraphModule, example_inputs):
    """A callable that runs `gm` eagerly once per new input signature, then replays a CUDA
    graph of it (module docstring). Falls back to running `gm` eagerly, counting a skip and
    saying why, when an input is not a CUDA tensor or an int."""
    fn = gm.forward
    why = None
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type != "cuda":
            why = f"an input is on {x.device}"
        elif not isinstance(x, (torch.Tensor, int, torch.SymInt)):
            why = f"an input is a {type(x).__name__}"
    if why is not None:
        counters["sm70attn"]["cuda_graph_skips"] += 1
        log.warning("sm70attn backend: no CUDA graph for this graph (%s); it runs eagerly", why)
        return fn
    in_place = written_inputs(gm.graph) | static_inputs(gm.graph)
    recordings: dict[tuple, _Recording] = {}
    warm: set[tuple] = set()

    def key(args) -> tuple:
        k = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                ptr = a.data_ptr() if i in in_place else None
                k.append((tuple(a.shape), a.stride(), a.dtype, a.device, ptr))
            else:
                k.append(a)
        return tuple(k)

    def run(*args):
        k = key(args)
        rec = recordings.get(k)
        if rec is None:
            if k not in warm:  # first call of a signature: eager (lazy init, cuBLAS, ...)
                warm.add(k)
                return fn(*args)
            if len(recordings) == MAX_RECORDINGS:
                log.warning(
                    "sm70attn backend: %d CUDA graphs recorded for one compiled graph, dropped "
                    "to record again: too many shapes (pad the batch: backend.pad_batch), or "
                    "new caches (reuse one: cache.reset())",
                    MAX_RECORDINGS,
                )
                recordings.clear()
            # all recordings of this graph share the memory pool of a live one
            pool = next(iter(recordings.values())).graph.pool() if recordings else None
            rec = recordings[k] = _Recording(fn, args, in_place, pool)
        return rec.replay(args)

    return run
