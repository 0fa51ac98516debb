"""Rewrite the quantized cache write into sm70attn.store_kv.

On a V100, inductor must see no FP8 arithmetic (Triton has no E4M3 type below SM89), so the
write of new K/V tokens into the E4M3 cache becomes one call of the fused op. Accepted
(both K and V, with the same slot mapping):

    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)   x [T, H_kv, D] float16,
        (torch.clamp(...), clamp(min=, max=))        scale: float / [] / [1] / [H_kv]
    The division must happen in float32 (x.float(), or a scale tensor that promotes): an
    fp16 x divided by a 0-d scale rounds the quotient to fp16 first, which the op does not.
    cache.view(-1, H_kv, D)[slot_mapping] = q                    slot assignment
    cache.view(-1, H_kv, D).index_put_((slot_mapping,), q)
    cache.view(-1, H_kv, D).index_copy_(0, slot_mapping, q)
    cache[slot_mapping // page_size, slot_mapping % page_size] = q

One difference, documented in the README: a slot of -1 is skipped by the op, while eager
indexing would write the last slot of the cache.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from .common import (
    FP8,
    Refused,
    agree,
    arg,
    erase_dead,
    fake,
    meta,
    one,
    root,
    same,
    same_shape,
    scale_node,
    shape,
    target_name,
    val,
    writes_between,
)

log = logging.getLogger("torch_sm70attn")
FP8_MAX = 448.0


class Write:
    """One recognised cache write: x (fp16 [T, H, D]) quantized by `scale` into `cache`."""

    def __init__(self, node: fx.Node):
        self.node = node
        name = target_name(node)
        if node.op == "call_function" and node.target is operator.setitem:
            dest, index, value = node.args
        elif name == "index_put_":
            dest, index, value = node.args[0], node.args[1], node.args[2]
            if arg(node, 3, "accumulate", False):
                raise Refused("index_put_ with accumulate=True")
        elif name == "index_copy_":
            dest, dim, index, value = node.args[:4]
            if dim != 0:
                raise Refused("index_copy_ along a dim other than the slot dim")
        else:
            raise Refused(f"{node.name} is not a cache write")
        self.cache, self.slots = self._destination(dest, index)
        self.x, self.scale = self._quantized(value)
        if dest is not self.cache:
            self.chain.append(dest)  # the private slot view

    def _destination(self, dest, index):
        if not isinstance(dest, fx.Node) or getattr(meta(dest), "dtype", None) != FP8:
            raise Refused("write into something other than a float8_e4m3fn cache")
        if isinstance(index, (tuple, list)) and len(index) == 1:
            index = index[0]
        if isinstance(index, fx.Node):  # cache.view(-1, H, D)[slots]
            if target_name(dest) not in ("view", "reshape", "flatten") or len(dest.users) != 1:
                raise Refused("slot write into something other than a private [slots, H, D] view")
            cache = dest.args[0]
            c = meta(cache)
            want = [c.shape[0] * c.shape[1], c.shape[2], c.shape[3]]
            if c.dim() != 4 or not same_shape(shape(dest), want):
                raise Refused("slot view is not cache.view(-1, H_kv, D)")
            if target_name(dest) != "view" and not c.is_contiguous():
                # reshape/flatten of a strided cache copies: eager's write would be lost
                raise Refused("slot write into reshape/flatten of a non-contiguous cache")
            return cache, self._slots(index)
        if isinstance(index, (tuple, list)) and len(index) == 2:  # cache[s // ps, s % ps]
            page, off = index
            c = meta(dest)
            ps = c.shape[1] if c.dim() == 4 else None
            if not (
                _binop(page, (operator.floordiv, "floordiv", "floor_divide"))
                and _binop(off, (operator.mod, "remainder", "fmod"))
            ):
                raise Refused("page/offset index is not (slots // page_size, slots % page_size)")
            if page.args[0] is not off.args[0] or not (
                ps is not None and same(val(page.args[1]), ps) and same(val(off.args[1]), ps)
            ):
                raise Refused("page/offset index does not use the cache's page size")
            return dest, self._slots(page.args[0])
        raise Refused("cache write index is not a slot mapping")

    @staticmethod
    def _slots(index):
        m = meta(index)
        if (
            not isinstance(m, torch.Tensor)
            or m.dim() != 1
            or m.dtype not in (torch.int32, torch.int64)
        ):
            raise Refused("cache write index is not a 1-D integer slot mapping")
        return index

    def _quantized(self, value):
        """x and scale of (x [.float()] / scale).clamp(-448, 448).to(float8_e4m3fn)."""
        to = value
        if target_name(to) != "to" or meta(to).dtype != FP8 or len(to.users) != 1:
            raise Refused("written value is not a private .to(float8_e4m3fn)")
        clamp = to.args[0]
        if target_name(clamp) != "clamp" or len(clamp.users) != 1:
            raise Refused("no clamp(-448, 448) before the fp8 conversion (no saturation)")
        lo, hi = arg(clamp, 1, "min"), arg(clamp, 2, "max")
        if (lo, hi) != (-FP8_MAX, FP8_MAX):
            raise Refused(f"clamp({lo}, {hi}) is not the E4M3 range")
        div = clamp.args[0]
        if target_name(div) not in ("truediv", "div") or len(div.users) != 1:
            raise Refused("quantized value is not x / scale")
        if div.kwargs.get("rounding_mode") is not None:
            raise Refused("division with a rounding mode")
        if meta(div).dtype != torch.float32:
            # fp16 x / a 0-d scale divides in fp16: rounding twice (fp16, then e4m3) can differ
            # from the op's single rounding of the float32 quotient.
            raise Refused(f"x / scale is computed in {meta(div).dtype}; write x.float() / scale")
        x, scale = div.args[0], div.args[1]
        if target_name(x) == "float" and len(x.users) == 1:
            x = x.args[0]
        xm = meta(x)
        if xm.dtype != torch.float16 or xm.dim() != 3:
            raise Refused(f"written tokens are {xm.dtype} {tuple(xm.shape)}, not float16 [T, H, D]")
        cm = meta(self.cache)
        if not same_shape(xm.shape[1:], cm.shape[2:]) or not agree(
            meta(self.slots).shape[0], xm.shape[0]
        ):
            raise Refused(
                f"tokens {tuple(xm.shape)} do not match the cache's [H_kv, D] and slots (broadcast write)"
            )
        if isinstance(scale, fx.Node):
            sm = meta(scale)
            s = list(sm.shape)
            if not one(sm.numel()) and (
                not same(sm.numel(), xm.shape[1]) or len(s) < 2 or not same(s[-2], xm.shape[1])
            ):
                raise Refused(f"scale of shape {s} does not vary along the KV heads alone")
        elif not isinstance(scale, (int, float)):
            raise Refused("scale is neither a number nor a tensor")
        self.chain = [to, clamp, div] + ([div.args[0]] if div.args[0] is not x else [])
        return x, scale


def _binop(node, names) -> bool:
    return isinstance(node, fx.Node) and (node.target in names or target_name(node) in names)


def _touches(node: fx.Node, caches) -> bool:
    """Reads or writes a cache, also through a view made earlier."""
    roots = {root(c) for c in caches}
    return any(root(a) in roots for a in node.all_input_nodes)


def rewrite_graph(graph: fx.Graph) -> int:
    """Pair the K and V cache writes of each slot mapping into one store_kv; returns how many."""
    writes = []
    for node in graph.nodes:
        name = target_name(node)
        if node.op in ("call_function", "call_method") and (
            node.target is operator.setitem or name in ("index_put_", "index_copy_")
        ):
            try:
                writes.append(Write(node))
            except Exception as e:  # noqa: BLE001 - a refusal, or a form the pass did not foresee
                if getattr(meta(node.args[0]), "dtype", None) == FP8:
                    counters["sm70attn"]["store_refused"] += 1
                    log.debug("sm70attn: cache write %s left unchanged: %s", node.name, e)
    done, used = 0, set()
    for i, a in enumerate(writes):
        for b in writes[i + 1 :]:
            if a in used or b in used or a.slots is not b.slots or a.cache is b.cache:
                continue
            order = {n: j for j, n in enumerate(graph.nodes)}
            if not same_shape(meta(a.cache).shape, meta(b.cache).shape):
                continue
            between = [n for n in graph.nodes if order[a.node] < order[n] < order[b.node]]
            if any(_touches(n, (a.cache, b.cache)) for n in between if n not in b.chain):
                counters["sm70attn"]["store_refused"] += 1
                log.debug("sm70attn: %s and %s have a cache read between them", a.node, b.node)
                continue
            # the K write moves to the V write: its tokens, slots and scale must not change
            why = writes_between(a.node, b.node, [a.x, a.slots, a.scale])
            if why:
                counters["sm70attn"]["store_refused"] += 1
                log.debug("sm70attn: %s and %s not paired: %s", a.node, b.node, why)
                continue
            _rewrite_pair(graph, a, b)
            used |= {a, b}
            done += 1
    for w in writes:
        if w not in used:
            counters["sm70attn"]["store_refused"] += 1
            log.debug("sm70attn: cache write %s has no K/V partner", w.node.name)
    counters["sm70attn"]["store_kv_rewrite"] += done
    return done


def _rewrite_pair(graph: fx.Graph, a: Write, b: Write) -> None:
    device = meta(a.x).device
    with graph.inserting_before(b.node):
        slots = a.slots
        if meta(slots).dtype != torch.int64:
            slots = fake(graph.call_method("to", (slots, torch.int64)))
        ks = scale_node(graph, a.scale, device)
        vs = scale_node(graph, b.scale, device)
        graph.call_function(
            torch.ops.sm70attn.store_kv.default, (a.x, b.x, a.cache, b.cache, slots, ks, vs)
        )
    erase_dead(graph, [a.node, b.node])
