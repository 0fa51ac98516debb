"""Rewrite "SDPA over a paged E4M3 cache" into sm70attn.paged_attention.

Works on the Dynamo (pre-grad) graph. Anchored on each SDPA call, it walks K and V back to
the page gather of a float8_e4m3fn cache, following only steps whose meaning it can track:

    cache[block_table]                       the page gather (plain indexing)
    cache.index_select(0, bt.view(-1))       the page gather on a page view
    .flatten / .view / .reshape              regrouping of dims (never splitting a page)
    .transpose / .permute / .contiguous      layout
    x[:, :, :L]                              a slice to the full static length (a no-op), or
                                             to L positions for decode (Q = 1) without a mask
    .to(float16) / .half() / .float()        the dequantizing conversion (fp8 -> fp16)
    * k_scale                                float, 0-d / [1] / per-KV-head tensor or buffer
    .repeat_interleave(G, dim=heads)         GQA expansion as written in plain PyTorch
    [:, :, None].expand(...).reshape(...)    GQA expansion as HF's repeat_kv writes it
    SDPA(..., enable_gqa=True)               GQA expansion inside SDPA

It tracks every dim of the tensor as a tuple of "atoms" of the cache: B (request), PG
(page slot in the table), OFF (offset in a page), H (KV head), G (query head in a group),
D (head dim). Atoms of size 1 carry no information and are dropped, so B=1 or H_kv=1
graphs need no special case. K must arrive at SDPA as [B, (H, G), (PG, OFF), D] in FP16:
then position t = pg * page_size + off and query head h = kv * G + g, exactly the op's
semantics. The mask must be sm70attn.verifier_mask(seq_lens, Q, capacity), or the same mask
written out with arange comparisons (fx_passes/mask.py proves it); or, for decode
(Q = 1), absent: every position kept (all, or the first L after a slice such as one
request's exact length) is visible, which is the op with seq_lens = L.

Under dynamic shapes (a serving loop recompiles as its batch and table width change) atom
sizes are SymInts: every size comparison asks whether it is provable (common.same) and adds
no guard, so the graph keeps serving every batch size. User code that reads K/V's sizes
(`k.shape[2]`) leaves `size()` nodes on the chain; they read no data, and the rewrite
recomputes them from the block table and the cache. Only what the kernels need as constants
(head dim, page size, KV heads, group size) is made static, once the rewrite is decided.

Whatever cannot be proven leaves the graph unchanged; the reason is logged at DEBUG on
logger "torch_sm70attn" and counted in torch._dynamo.utils.counters["sm70attn"]. Where the
SDPA reads a float8 cache (the model asked for this backend, so a refusal is news), the
cause and what to change are logged once per source line at WARNING. An SDPA of provably more
query rows than the kernels take (a prefill) is left as it is without trying, and counted.
"""

from __future__ import annotations

import logging
import math
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_sm70attn import routes
from torch_sm70attn.manifest import MANIFEST

from .common import (
    FP8,
    Refused,
    arg,
    erase_dead,
    fake,
    known_int,
    meta,
    one,
    same,
    same_shape,
    scale_node,
    shape,
    static,
    target_name,
    val,
    writes_between,
)
from .mask import Offset, seq_lens_of_mask

log = logging.getLogger("torch_sm70attn")
SDPA = (
    torch._C._nn.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)
VERIFIER_MASK = torch.ops.sm70attn.verifier_mask.default


# --- the tracked layout -----------------------------------------------------------------
@dataclass
class Layout:
    dims: list[tuple[str, ...]]  # atoms of each dim, outermost first (size-1 atoms dropped)
    sizes: dict  # atom -> int, or SymInt under dynamic shapes
    dtype: torch.dtype
    scale: object = None  # the multiplier: None, a Python number or an fx.Node
    nodes: list[fx.Node] = field(default_factory=list)  # the chain, gather first
    cache: fx.Node | None = None
    bt: fx.Node | None = None  # the block table (int32 as the user holds it)
    length: object = None  # K/V cut to their first `length` positions (int or size node)
    gather: fx.Node | None = None  # where eager reads the cache and the table
    scaled_at: fx.Node | None = None  # where eager reads a scale tensor
    dims_at: dict = field(default_factory=dict)  # chain node -> (dims, length) of its output

    def atoms(self, dims):
        return tuple(a for a in dims if not one(self.sizes[a]))

    def shape(self):
        t = self.atoms(("PG", "OFF"))
        return [
            val(self.length)
            if self.length is not None and d == t
            else math.prod((self.sizes[a] for a in d), start=1)
            for d in self.dims
        ]

    def record(self, node: fx.Node) -> None:
        self.nodes.append(node)
        self.dims_at[node] = (list(self.dims), self.length)


def _regroup(lay: Layout, new_shape) -> list[tuple[str, ...]]:
    """Dims of a view/reshape: the same atom sequence cut at the new boundaries (sizes may be
    symbolic: each boundary must be provable). K/V cut to a length keep their position dim
    whole (a pseudo-atom "T" of that length)."""
    t = lay.atoms(("PG", "OFF"))
    cut = lay.length is not None
    sizes = dict(lay.sizes, T=val(lay.length)) if cut else lay.sizes
    seq = [a for d in lay.dims for a in (("T",) if cut and d == t else d)]
    out, i = [], 0
    for s in new_shape:
        grp, prod = [], 1
        while not same(prod, s) and i < len(seq):
            grp.append(seq[i])
            prod *= sizes[seq[i]]
            i += 1
        if not same(prod, s):
            raise Refused(f"reshape to {list(new_shape)} splits a tracked dim")
        if cut and "T" in grp and grp != ["T"]:
            raise Refused("reshape merges the cut position dim with another")
        out.append(t if grp == ["T"] else tuple(grp))
    if i != len(seq):
        raise Refused(f"reshape to {list(new_shape)} drops dims")
    return out


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _int32_source(idx: fx.Node) -> fx.Node:
    """bt for bt.long() / bt.to(torch.int64) / bt.int(): the table as the user holds it."""
    while (
        isinstance(idx, fx.Node) and idx.op == "call_method" and idx.target in ("long", "int", "to")
    ):
        if meta(idx).dtype.is_floating_point or meta(idx.args[0]).dtype.is_floating_point:
            break
        idx = idx.args[0]
    return idx


def _start(gather: fx.Node) -> Layout:
    """Layout right after the page gather (with its cache and block-table nodes)."""
    name = target_name(gather)
    if name in ("getitem", "index") and gather.op == "call_function":
        cache, idx = gather.args[0], gather.args[1]
        if isinstance(idx, (tuple, list)):
            if len(idx) != 1:
                raise Refused("cache indexed by more than the page id")
            idx = idx[0]
        if not isinstance(idx, fx.Node) or not isinstance(meta(idx), torch.Tensor):
            raise Refused("cache indexed by something other than a block table")
        bt = _int32_source(idx)
        if meta(bt).dim() != 2:
            raise Refused("block table is not 2-D [B, max_pages]")
        merged = False
        dead = []
    elif name == "index_select":
        cache, dim, idx = gather.args[0], arg(gather, 1, "dim"), arg(gather, 2, "index")
        if dim != 0:
            raise Refused("index_select along a dim other than the page dim")
        # idx must be block_table flattened: bt.view(-1) / bt.reshape(-1) / bt.flatten()
        if not isinstance(idx, fx.Node) or target_name(idx) not in ("view", "reshape", "flatten"):
            raise Refused("index_select index is not a flattened block table")
        bt = _int32_source(idx.args[0])
        if meta(bt).dim() != 2 or not same_shape(shape(idx), [meta(bt).numel()]):
            raise Refused("index_select index is not a flattened block table")
        if len(idx.users) != 1:
            raise Refused(f"{idx.name} is used elsewhere")
        merged = True
        dead = [idx]
    else:
        raise Refused(f"K/V does not come from a page gather (reached {gather.name})")
    c = meta(cache)
    if not isinstance(c, torch.Tensor) or c.dtype != FP8:
        raise Refused(f"cache {getattr(cache, 'name', cache)} is not float8_e4m3fn")
    if c.dim() != 4:
        raise Refused("cache is not 4-D [P, page_size, H_kv, D]")
    if meta(bt).dtype not in (torch.int32, torch.int64):
        raise Refused("block table is not an integer tensor")
    B, MP = shape(bt)
    _, ps, H, D = shape(cache)
    sizes = {"B": B, "PG": MP, "OFF": ps, "H": H, "D": D, "G": 1}
    lay = Layout([], sizes, FP8, cache=cache, bt=bt, gather=gather)
    dims = [("B", "PG")] if merged else [("B",), ("PG",)]
    lay.dims = [lay.atoms(d) for d in dims + [("OFF",), ("H",), ("D",)]]
    if dead:
        lay.dims_at[dead[0]] = ([lay.atoms(("B", "PG"))], None)
        lay.nodes.append(dead[0])
    lay.record(gather)
    return lay


def _step(lay: Layout, node: fx.Node) -> None:
    """Apply one chain node to the layout, or refuse."""
    name = target_name(node)
    out = meta(node)
    n = len(lay.dims)
    if name in ("view", "reshape", "flatten", "_unsafe_view", "unflatten"):
        if out.dtype != lay.dtype:
            raise Refused(f"{node.name} reinterprets K/V as {out.dtype}")
        lay.dims = [lay.atoms(d) for d in _regroup(lay, shape(node))]
    elif name in ("transpose", "swapaxes"):
        a, b = _dim(arg(node, 1, "dim0"), n), _dim(arg(node, 2, "dim1"), n)
        lay.dims[a], lay.dims[b] = lay.dims[b], lay.dims[a]
    elif name == "permute":
        order = node.args[1:] if node.op == "call_method" else node.args[1]
        if len(order) == 1 and isinstance(order[0], (tuple, list)):
            order = order[0]
        lay.dims = [lay.dims[_dim(d, n)] for d in order]
    elif name in ("contiguous", "clone"):
        pass
    elif name == "unsqueeze":
        lay.dims.insert(_dim(arg(node, 1, "dim"), n + 1), ())
    elif name in ("to", "half", "float", "_to_copy", "type"):
        if out.dtype not in (torch.float16, torch.float32):
            raise Refused(f"conversion to {out.dtype}")
        if out.device != meta(node.args[0]).device:
            raise Refused("device change inside the K/V chain")
        lay.dtype = out.dtype
    elif name in ("mul", "mul_"):
        _scale_step(lay, node)
    elif name == "repeat_interleave":
        reps, d = val(arg(node, 1, "repeats")), arg(node, 2, "dim")
        if not isinstance(reps, (int, torch.SymInt)) or d is None:
            raise Refused("repeat_interleave without a repeat count and dim")
        d = _dim(d, n)
        if lay.dims[d] != lay.atoms(("H",)) or not one(lay.sizes["G"]):
            raise Refused("repeat_interleave on a dim other than the KV heads")
        lay.sizes["G"] = reps
        lay.dims[d] = lay.atoms(("H", "G"))
    elif name == "expand":
        new = shape(node)
        old = lay.shape()
        if len(new) != n:
            raise Refused("expand adds dims")
        for i, (o, s) in enumerate(zip(old, new, strict=True)):
            if same(o, s):
                continue
            if lay.dims[i] != () or not one(lay.sizes["G"]):
                raise Refused("expand of a dim other than a fresh group dim")
            lay.sizes["G"] = s
            lay.dims[i] = ("G",)
    elif name in ("getitem", "slice"):
        _index_step(lay, node)
    else:
        raise Refused(f"{node.name} ({name}) is not a step the pass can track")
    if not same_shape(lay.shape(), list(out.shape)):
        raise Refused(f"lost track of the layout at {node.name}")


def _index_step(lay: Layout, node: fx.Node) -> None:
    """x[:, :, None] (HF repeat_kv) and full slices; anything else is refused."""
    if node.op != "call_function" or target_name(node) != "getitem":
        raise Refused(f"{node.name}: aten slicing of K/V")
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    consumed = sum(1 for j in idx if j is not None and j is not Ellipsis)
    shape = lay.shape()
    dims, i = [], 0

    def plain(ix):  # a slice from the start with step 1
        return isinstance(ix, slice) and ix.start in (None, 0) and ix.step in (None, 1)

    for ix in idx:
        if ix is None:
            dims.append(())
        elif ix is Ellipsis:
            rest = len(lay.dims) - consumed
            dims.extend(lay.dims[i : i + rest])
            i += rest
        elif plain(ix) and (ix.stop is None or statically_known_true(val(ix.stop) >= shape[i])):
            dims.append(lay.dims[i])  # a slice to the full length is a no-op
            i += 1
        elif (
            plain(ix)
            and isinstance(val(ix.stop), (int, torch.SymInt))
            and statically_known_true(val(ix.stop) > 0)
            and statically_known_true(val(ix.stop) < shape[i])
            and lay.dims[i] == lay.atoms(("PG", "OFF"))
            and lay.length is None
        ):
            lay.length = ix.stop  # the first `stop` positions: valid only without a mask, Q = 1
            dims.append(lay.dims[i])
            i += 1
        else:
            raise Refused(f"indexing K/V with {ix!r} (only None and full slices are tracked)")
    lay.dims = dims + lay.dims[i:]


def _scale_step(lay: Layout, node: fx.Node) -> None:
    s = node.args[1] if node.args[0] is lay.nodes[-1] else node.args[0]
    if lay.scale is not None:
        raise Refused("K/V multiplied by a scale twice")
    if lay.dtype == FP8:
        raise Refused("scale applied before the conversion from fp8")
    if isinstance(s, (int, float)):
        lay.scale = float(s)
        return
    lay.scaled_at = node
    sm = meta(s)
    if not isinstance(sm, torch.Tensor) or not sm.is_floating_point():
        raise Refused("K/V multiplied by something other than a float scale")
    if one(sm.numel()):
        lay.scale = s
        return
    # Right-aligned broadcast: the scale may vary along the KV-head dim alone.
    shape = list(sm.shape)
    if len(shape) > len(lay.dims):
        raise Refused("scale has more dims than K/V")
    varying = [i for i, sz in enumerate(shape) if not one(sz)]
    off = len(lay.dims) - len(shape)
    if len(varying) != 1 or lay.dims[off + varying[0]] != ("H",):
        raise Refused(f"scale of shape {shape} does not vary along the KV heads alone")
    lay.scale = s


def _source(node: fx.Node) -> fx.Node:
    """The tensor a chain step transforms (for mul: the operand shaped like the result)."""
    if target_name(node) in ("mul", "mul_"):
        out = shape(node)
        cands = [a for a in node.args[:2] if isinstance(a, fx.Node) and same_shape(shape(a), out)]
        if len(cands) != 1:
            raise Refused(f"{node.name}: cannot tell K/V from its scale")
        return cands[0]
    return node.args[0]


def _is_gather(node: fx.Node) -> bool:
    if target_name(node) == "index_select":
        return True
    src = node.args[0]
    return (
        target_name(node) in ("getitem", "index")
        and isinstance(src, fx.Node)
        and getattr(meta(src), "dtype", None) == FP8
    )


# Under dynamic shapes, user code such as `T = k.shape[2]` reads K/V's sizes: Dynamo records
# `k.size()` nodes. They read no data, so they do not keep the chain alive: the rewrite
# recomputes them from the block table and the cache (`_rewire_sizes`).
def _size_query(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "size") or (
        node.target is torch.ops.aten.sym_size.int
    )


def _check_size_query(q: fx.Node) -> None:
    if arg(q, 1, "dim") is None and not all(
        target_name(u) == "getitem" and isinstance(u.args[1], int) for u in q.users
    ):
        raise Refused(
            f"the shape of {q.args[0].name} is used whole",
            "read single sizes (k.shape[2]) or take them from the block table and the cache",
        )


def _trace_back(node: fx.Node, sdpa: fx.Node) -> Layout:
    """Chain from the gather to SDPA's input `node`; no link may be used elsewhere (but for
    reads of its sizes)."""
    chain, user = [], sdpa
    cur = node
    while True:
        if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
            raise Refused(
                f"K/V does not come from a page gather (reached {getattr(cur, 'name', cur)})",
                "gather K/V from the float8 cache with cache[block_table] or index_select",
            )
        others = [u for u in cur.users if u is not user and not _size_query(u)]
        if others:
            raise Refused(
                f"{cur.name} is used elsewhere (by {others[0].name}): the rewrite would have "
                "to keep the gathered K/V",
                "use the dequantized K/V only for the attention",
            )
        for q in cur.users:
            if _size_query(q):
                _check_size_query(q)
        chain.append(cur)
        if _is_gather(cur):
            break
        user, cur = cur, _source(cur)
    chain.reverse()
    lay = _start(chain[0])
    for n in chain[1:]:
        _step(lay, n)
        lay.record(n)
    return lay


def _size_node(graph: fx.Graph, lay: Layout, atoms) -> int | fx.Node:
    """The product of atom sizes as a constant, or as nodes reading the table and cache."""
    src = {"B": (lay.bt, 0), "PG": (lay.bt, 1), "OFF": (lay.cache, 1), "H": (lay.cache, 2)}
    src["D"] = (lay.cache, 3)
    const, out = 1, None
    for a in atoms:
        k = known_int(lay.sizes[a])
        if k is not None:
            const *= k
            continue
        if a not in src:
            raise Refused(f"symbolic size of {a}")  # G: made static before any rewrite
        n = fake(graph.call_method("size", src[a]))
        out = n if out is None else fake(graph.call_function(operator.mul, (out, n)))
    if out is None:
        return const
    return out if const == 1 else fake(graph.call_function(operator.mul, (out, const)))


def _replace(node: fx.Node, new) -> None:
    """Replace every use of `node` by `new`, a node or a constant."""
    for u in list(node.users):
        u.args, u.kwargs = fx.node.map_arg((u.args, u.kwargs), lambda a: new if a is node else a)


def _rewire_sizes(graph: fx.Graph, lay: Layout) -> None:
    """Replace reads of the chain's sizes by the same sizes computed from table and cache."""
    for c in lay.nodes:
        dims, length = lay.dims_at[c]
        for q in [u for u in c.users if _size_query(u)]:
            d = arg(q, 1, "dim")
            reads = [(q, d)] if d is not None else [(u, u.args[1]) for u in q.users]
            for user, i in reads:
                i = _dim(i, len(dims))
                t = lay.atoms(("PG", "OFF"))
                with graph.inserting_before(user):
                    if length is not None and dims[i] == t:
                        new = length
                    else:
                        new = _size_node(graph, lay, dims[i])
                _replace(user, new)
                graph.erase_node(user)
            if d is None:
                graph.erase_node(q)


# --- the rewrite --------------------------------------------------------------------------
MASK_FIX = (
    "pass attn_mask=torch_sm70attn.verifier_mask(seq_lens, Q, k.shape[2]), or the same mask "
    "as arange comparisons (README, 'With torch.compile')"
)


def _check_kv(lay: Layout, H_q, gqa: bool, what: str) -> None:
    heads = ("H",) if gqa else ("H", "G")
    want = [lay.atoms(a) for a in (("B",), heads, ("PG", "OFF"), ("D",))]
    if lay.dims != want:
        raise Refused(
            f"{what} arrives as {lay.dims}, not [B, heads, pages * page_size, D]",
            "gather pages in table order, flatten (pages, page_size) into positions, and "
            "expand KV heads as repeat_interleave(G, dim=1), repeat_kv or enable_gqa=True",
        )
    if lay.dtype != torch.float16:
        raise Refused(
            f"{what} is {lay.dtype} at SDPA, not float16", "convert K/V with .to(torch.float16)"
        )
    H = lay.sizes["H"]
    G = H_q // H if gqa and one(lay.sizes["G"]) else lay.sizes["G"]
    if not same(G * H, H_q):
        raise Refused(f"{what}: {H} KV heads x group {G} != {H_q} query heads")


def _seq_lens(graph, sdpa, mask, k: Layout, v: Layout, B, Q, T):
    """The op's seq_lens: the verifier mask's, or None for decode without a mask (every key
    visible, also with K/V cut to a length, e.g. one request's exact length: the op then
    takes the gathered length, `_gathered_lens`). Adds nothing to the graph."""
    if mask is None:
        if not one(Q):
            raise Refused(f"no attn_mask with Q = {Q} > 1 (rows would see the same keys)", MASK_FIX)
        if not (
            k.length is v.length
            or (
                k.length is not None and v.length is not None and same(val(k.length), val(v.length))
            )
        ):
            raise Refused("K and V cut to different lengths")
        return None
    if k.length is not None or v.length is not None:
        raise Refused("K/V cut to a length shorter than the table, with a mask")
    if not isinstance(mask, fx.Node):
        raise Refused("attn_mask is not sm70attn.verifier_mask(...)", MASK_FIX)
    if mask.target is VERIFIER_MASK:
        seq_lens, q_rows, kv_len = (
            arg(mask, i, n) for i, n in enumerate(("seq_lens", "q_rows", "kv_len"))
        )
        if not (same(val(q_rows), Q) and same(val(kv_len), T)):
            raise Refused(
                f"verifier_mask(q_rows={val(q_rows)}, kv_len={val(kv_len)}) != (Q={Q}, T={T})",
                MASK_FIX,
            )
    else:  # the same mask written out with arange comparisons
        try:
            seq_lens = seq_lens_of_mask(mask, B, Q, T)
        except Refused as e:
            raise Refused(
                f"attn_mask is not sm70attn.verifier_mask(...) nor its arange form: {e}", MASK_FIX
            ) from None
        if isinstance(seq_lens, Offset):  # every request holds c + Q: built at the SDPA
            why = writes_between(graph._root, sdpa, [n for n, _ in seq_lens.terms])
            if why:
                raise Refused(why)
            return seq_lens
    if meta(seq_lens).dtype != torch.int32:
        raise Refused("seq_lens is not int32", "keep seq_lens int32 (the op's dtype)")
    # eager read seq_lens where the mask was built (the arange form: from the graph's start)
    start = mask if mask.target is VERIFIER_MASK else graph._root
    why = writes_between(start, sdpa, [seq_lens])
    if why:
        raise Refused(why)
    return seq_lens


def _offset_lens(graph: fx.Graph, off: Offset, k: Layout, device) -> fx.Node:
    """seq_lens of requests that all hold c + Q tokens: [B] int32 (mask.Offset)."""
    total = off.literal
    ints = [(n, s) for n, s in off.terms if not isinstance(meta(n), torch.Tensor)]
    tensors = [(n, s) for n, s in off.terms if isinstance(meta(n), torch.Tensor)]
    for n, s in [*ints, (off.q, 1)]:
        total = fake(graph.call_function(operator.add if s > 0 else operator.sub, (total, n)))
    rows = _size_node(graph, k, ("B",))
    kw = {"dtype": torch.int32, "device": device}
    lens = fake(graph.call_function(torch.full, ((rows,), total), kw))
    for n, s in tensors:  # a 0-d length tensor: int32 + int64 0-d stays int32
        lens = fake(graph.call_function(operator.add if s > 0 else operator.sub, (lens, n)))
    return lens


def _gathered_lens(graph: fx.Graph, k: Layout, device) -> fx.Node:
    """seq_lens of an unmasked decode: [B] int32 filled with the gathered (or cut) length."""
    n = k.length if k.length is not None else _size_node(graph, k, ("PG", "OFF"))
    rows = _size_node(graph, k, ("B",))
    return fake(
        graph.call_function(torch.full, ((rows,), n), {"dtype": torch.int32, "device": device})
    )


def rewrite_sdpa(graph: fx.Graph, sdpa: fx.Node) -> None:
    q_node, k_node, v_node = (arg(sdpa, i, n) for i, n in enumerate(("query", "key", "value")))
    if not all(isinstance(x, fx.Node) for x in (q_node, k_node, v_node)):
        raise Refused("SDPA query/key/value are not graph tensors")
    mask = arg(sdpa, 3, "attn_mask")
    if arg(sdpa, 4, "dropout_p", 0.0) != 0.0:
        raise Refused("dropout_p != 0", "call SDPA with dropout_p=0 when serving")
    if arg(sdpa, 5, "is_causal", False):
        raise Refused("is_causal=True (the op's mask is the verifier mask)", MASK_FIX)
    scale = arg(sdpa, 6, "scale")
    gqa = bool(sdpa.kwargs.get("enable_gqa", False))
    q = meta(q_node)
    if q.dim() != 4:
        raise Refused("query is not 4-D")
    B, H_q, Q, D = q.shape
    k, v = _trace_back(k_node, sdpa), _trace_back(v_node, sdpa)
    if q.dtype != torch.float16:
        raise Refused(f"query is {q.dtype}, not float16", "run attention in float16")
    _check_kv(k, H_q, gqa, "K")
    _check_kv(v, H_q, gqa, "V")
    if k.bt is not v.bt:
        raise Refused("K and V use different block tables")
    if not all(same(k.sizes[a], v.sizes[a]) for a in k.sizes):
        raise Refused("K and V caches differ in shape")
    if not (same(k.sizes["B"], B) and same(k.sizes["D"], D)):
        raise Refused("query and cache disagree on batch or head dim")
    T = k.sizes["PG"] * k.sizes["OFF"]
    if meta(k.bt).dtype != torch.int32:
        raise Refused(
            "block_table is not int32", "keep block_table int32 (index the cache with bt.long())"
        )
    if not one(q.stride(-1)):
        raise Refused("query last dim is not contiguous")
    if routes.disabled():
        raise Refused("TORCH_SM70ATTN_DISABLE=1")
    if scale is not None and not isinstance(scale, (int, float)):
        raise Refused("SDPA scale is not a Python number")
    seq_lens = _seq_lens(graph, sdpa, mask, k, v, B, Q, T)
    # The op reads everything at the SDPA; eager read the cache and table at the gather, a
    # scale at its multiply, seq_lens where the mask was built: nothing may write them between.
    for lay in (k, v):
        why = writes_between(lay.gather, sdpa, [lay.cache, lay.bt])
        if why is None and lay.scaled_at is not None:
            why = writes_between(lay.scaled_at, sdpa, [lay.scale])
        if why:
            raise Refused(why)
    # Decided but for the manifest: the sizes the kernels need as constants become static
    # (guarded by Dynamo: a new head dim or page size recompiles); batch, table width, pages
    # and query rows stay symbolic (the manifest's bounds on them become range guards).
    for x in (D, H_q, k.sizes["OFF"], k.sizes["H"], k.sizes["G"]):
        static(x)
    why = routes.shape_refusal(q, meta(k.cache), meta(k.bt))
    if why:
        raise Refused(
            why,
            "none in the model: the kernels do not serve this shape (torch_sm70attn.capabilities())",
        )
    if scale is None:
        scale = static(D) ** -0.5

    with graph.inserting_before(sdpa):
        if seq_lens is None:
            seq_lens = _gathered_lens(graph, k, q.device)
        elif isinstance(seq_lens, Offset):
            seq_lens = _offset_lens(graph, seq_lens, k, q.device)
        ks = scale_node(graph, k.scale, q.device)
        vs = scale_node(graph, v.scale, q.device)
        fused = graph.call_function(
            torch.ops.sm70attn.paged_attention.default,
            (q_node, k.cache, v.cache, k.bt, seq_lens, float(scale), ks, vs),
        )
    fake(fused)
    _rewire_sizes(graph, k)
    _rewire_sizes(graph, v)
    sdpa.replace_all_uses_with(fused)
    erase_dead(graph, [sdpa])


def _reads_fp8(node: fx.Node, limit: int = 256) -> bool:
    """Whether `node` reads a float8_e4m3fn tensor within `limit` nodes upstream."""
    seen, work = set(), list(node.all_input_nodes)
    while work and len(seen) < limit:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if getattr(n.meta.get("example_value", n.meta.get("val")), "dtype", None) == FP8:
            return True
        work.extend(n.all_input_nodes)
    return False


def _site(node: fx.Node) -> str:
    """The user's source line of `node` (file:line in function), or its name."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")
    return "{}:{} in {}".format(*frames[-1]) if frames else node.name


_warned: set = set()


def _warn_refusal(node: fx.Node, why: str, fix: str | None) -> None:
    """Once per source line and reason: the model asked for this backend and attention over
    its float8 cache stays on the slow path."""
    site = _site(node)
    if (site, why) in _warned:
        return
    _warned.add((site, why))
    log.warning(
        "sm70attn: the attention at %s stays on the slow gather path: %s.%s",
        site,
        why,
        f" To fix: {fix}." if fix else "",
    )


def _prefill(node: fx.Node) -> bool:
    """An SDPA of provably more query rows than the kernels take: a prefill (a prompt, the
    transformers attention's prefill route), which stays SDPA by design, so its refusal is no
    news. Symbolic rows that may be fewer are tried as any other SDPA."""
    q = arg(node, 0, "query")
    q = q.meta.get("example_value", q.meta.get("val")) if isinstance(q, fx.Node) else None
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return False
    return statically_known_true(q.shape[2] > MANIFEST.query_rows[-1])


def rewrite_graph(graph: fx.Graph) -> int:
    """Rewrite every provable SDPA-over-paged-cache in `graph`; returns how many."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA:
            continue
        if _prefill(node):
            counters["sm70attn"]["sdpa_prefill_kept"] += 1
            log.debug(
                "sm70attn: SDPA %s has more query rows than the kernels take: kept", node.name
            )
            continue
        try:
            rewrite_sdpa(graph, node)
        except Exception as e:  # noqa: BLE001 - a refusal, or a form the pass did not foresee
            counters["sm70attn"]["sdpa_refused"] += 1
            if isinstance(e, Refused):
                why, fix = str(e), e.fix
            else:
                why = f"a form the pass did not foresee ({e!r})"
                fix = "please report it with the graph (TORCH_LOGS=graph_code)"
            log.debug("sm70attn: SDPA %s left unchanged: %s", node.name, why)
            if _reads_fp8(node) and not routes.disabled():
                _warn_refusal(node, why, fix)
            continue
        counters["sm70attn"]["paged_attention_rewrite"] += 1
        log.debug("sm70attn: SDPA %s -> sm70attn.paged_attention", node.name)
        done += 1
    return done
