"""Recognise the verifier mask written out with arange comparisons, e.g.

    t = torch.arange(T)
    last = seq_lens[:, None] - Q + torch.arange(Q)
    mask = (t[None, None, :] <= last[:, :, None])[:, None]          # [B, 1, Q, T]
    mask = t.view(1, 1, 1, T) < (last + 1).view(B, 1, Q, 1)         # the same mask

Each tensor is tracked as an integer affine form over seq_lens[b] ("S") and arange indices,
with the axis each term varies along; a comparison (<, <=, >, >=, either way round)
normalises to f >= 0. Dims are placed with None indexing, unsqueeze, or a view/reshape that
only adds or drops size-1 dims, or an expand of size-1 dims. The mask is
sm70attn.verifier_mask(seq_lens, Q, T) exactly when f = S - Q + r - t over the axes
[b, 1, r, t], with r an arange of Q and t an arange of T. Sizes (Q, T, and constants such as
Q itself) may be symbolic under dynamic shapes.

Without seq_lens, f = c + r - t over [1, 1, r, t] (expanded over the batch) is the mask of
requests that all hold c + Q tokens, as transformers' sdpa mask writes it:
`kv_arange <= arange(Q) + past`. c is a literal plus scalars of the graph (ints, SymInts, or
0-d integer tensors such as a cache's length): `Offset`, from which the rewrite builds
seq_lens = full(B, c + Q). As with seq_lens, c + Q must not exceed T (the op clamps the
length to the table's capacity): a literal or SymInt c that provably does is refused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .common import Refused, known_int, meta, one, same, same_shape, shape, target_name, val


@dataclass
class Form:
    coef: dict  # symbol -> integer coefficient ("S", or an arange node's name)
    const: object  # int, or SymInt under dynamic shapes
    axes: list  # per dim: the symbol the dim indexes, or None (size 1)
    seq_lens: fx.Node | None = None
    cond: bool = False  # a comparison: the mask is f >= 0
    terms: tuple = ()  # (node, sign): the graph's scalars in const (a 0-d tensor's is not)


@dataclass
class Offset:
    """Every request holds c + Q tokens, c = literal + sum(sign * term); Q is an int or the
    node arange(Q) was given."""

    literal: int
    terms: tuple
    q: object


ADD = (operator.add, torch.add, "add")
SUB = (operator.sub, torch.sub, "sub")
CMP = {"le": 0, "lt": -1, "ge": 0, "gt": -1}  # f >= 0 with f = hi - lo + offset


def _op(node, names) -> bool:
    return node.target in names or target_name(node) in names


def _reaxis(axes: list, old: list, new: list) -> list:
    """Axes after a view/reshape that only adds or drops size-1 dims."""
    kept = [(a, s) for a, s in zip(axes, old, strict=True) if not one(s)]
    out = []
    for s in new:
        if one(s):
            out.append(None)
        elif kept and same(kept[0][1], s):
            out.append(kept.pop(0)[0])
        else:
            raise Refused(f"mask reshaped from {old} to {new} (only size-1 dims may change)")
    if kept:
        raise Refused(f"mask reshaped from {old} to {new} (only size-1 dims may change)")
    return out


def _arange_size(node: fx.Node):
    """n of torch.arange(n) / arange(0, n) (int or SymInt), else None."""
    args = [a for a in node.args if not isinstance(a, torch.dtype)]
    if len(args) == 2 and args[0] == 0:
        args = args[1:]
    if len(args) != 1 or node.kwargs.get("start", 0) != 0 or node.kwargs.get("step", 1) != 1:
        return None
    n = val(args[0])
    return n if isinstance(n, (int, torch.SymInt)) else None


def _form(node) -> Form:
    if isinstance(node, int):
        return Form({}, node, [])
    if not isinstance(node, fx.Node):
        raise Refused(f"mask built from {node!r}")
    name = target_name(node)
    v = meta(node)
    if isinstance(v, (int, torch.SymInt)):  # a size (q.shape[2]), an offset, ...
        return Form({}, v, [], terms=((node, 1),))
    if node.op == "call_function" and node.target is torch.arange:
        n = _arange_size(node)
        if n is None:
            raise Refused("mask arange is not arange(n)")
        if one(n):  # arange(1) is the constant 0
            return Form({}, 0, [None])
        return Form({node.name: 1}, 0, [node.name])
    if name in ("long", "int", "to") and node.op == "call_method":
        if meta(node).dtype not in (torch.int32, torch.int64):
            raise Refused(f"mask converted to {meta(node).dtype} (floating point or narrowing)")
        return _form(node.args[0])
    if _op(node, ADD) or _op(node, SUB):
        if node.kwargs or len(node.args) != 2:
            raise Refused(f"{node.name}: add/sub with extra arguments (alpha=...)")
        a, b = _form(node.args[0]), _form(node.args[1])
        sign = -1 if _op(node, SUB) else 1
        return _combine(a, b, sign)
    if name in CMP:
        if node.kwargs or len(node.args) != 2:
            raise Refused(f"{node.name}: comparison with keyword arguments")
        lo, hi = (node.args[0], node.args[1]) if name in ("le", "lt") else node.args[1::-1]
        f = _combine(_form(hi), _form(lo), -1)
        f.const += CMP[name]
        f.cond = True
        return f
    if name == "getitem" and node.op == "call_function":
        f = _form(node.args[0])
        idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        axes, i = [], 0
        for ix in idx:
            if ix is None:
                axes.append(None)
            elif ix == slice(None):
                axes.append(f.axes[i])
                i += 1
            else:
                raise Refused(f"mask indexed with {ix!r}")
        f.axes = axes + f.axes[i:]
        return f
    if name == "unsqueeze":
        f = _form(node.args[0])
        d = node.args[1]
        f.axes.insert(d if d >= 0 else d + len(f.axes) + 1, None)
        return f
    if name == "expand" and node.op == "call_method":
        f = _form(node.args[0])
        old, new = shape(node.args[0]), shape(node)
        for a, b in zip(old, new[len(new) - len(old) :], strict=True):
            if not (same(a, b) or one(a)):
                raise Refused(f"mask expanded from {old} to {new}")
        f.axes = [None] * (len(new) - len(old)) + f.axes  # broadcast dims stay None
        return f
    if name in ("view", "reshape"):
        f = _form(node.args[0])
        f.axes = _reaxis(f.axes, shape(node.args[0]), shape(node))
        return f
    if (
        isinstance(v, torch.Tensor)
        and v.dim() == 1
        and v.dtype == torch.int32
        and node.op == "placeholder"
    ):
        return Form({"S": 1}, 0, ["b"], seq_lens=node)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype in (torch.int32, torch.int64):
        # e.g. a cache's length kept as a tensor (after .long()/.to() were looked through, so
        # that the write check sees the tensor itself)
        return Form({}, 0, [], terms=((node, 1),))
    raise Refused(f"mask built with {node.name} ({name})")


def _combine(a: Form, b: Form, sign: int) -> Form:
    n = max(len(a.axes), len(b.axes))
    pa, pb = [None] * (n - len(a.axes)) + a.axes, [None] * (n - len(b.axes)) + b.axes
    axes = []
    for x, y in zip(pa, pb, strict=True):
        if x is not None and y is not None and x != y:
            raise Refused("mask terms broadcast along different axes")
        axes.append(x if x is not None else y)
    if a.cond or b.cond:
        raise Refused("arithmetic on a comparison")
    coef = dict(a.coef)
    for k, c in b.coef.items():
        coef[k] = coef.get(k, 0) + sign * c
    coef = {k: c for k, c in coef.items() if c}
    if a.seq_lens is not None and b.seq_lens is not None and a.seq_lens is not b.seq_lens:
        raise Refused("mask uses two seq_lens tensors")
    terms = a.terms + tuple((n, sign * k) for n, k in b.terms)
    return Form(coef, a.const + sign * b.const, axes, a.seq_lens or b.seq_lens, terms=terms)


def seq_lens_of_mask(mask: fx.Node, B, Q, T) -> fx.Node | Offset:
    """seq_lens, or the Offset every request holds, if `mask` is the verifier mask written out
    with arange comparisons."""
    f = _form(mask)
    if not f.cond:
        raise Refused("attn_mask is neither sm70attn.verifier_mask nor an arange comparison")
    if not same_shape(shape(mask), [B, 1, Q, T]) or len(f.axes) != 4:
        raise Refused(f"arange mask has shape {shape(mask)}, not [B, 1, Q, T]")
    b, head, r, t = f.axes
    aranges = {n.name: n for n in mask.graph.nodes if n.target is torch.arange}
    sizes = {k: _arange_size(n) for k, n in aranges.items()}
    sizes = {k: n for k, n in sizes.items() if n is not None}
    rows_and_keys = (
        head is None
        and r != t
        and (r in sizes and same(sizes[r], Q) if r is not None else one(Q))
        and t in sizes
        and same(sizes[t], T)
    )
    tensors = [n for n, _ in f.terms if isinstance(meta(n), torch.Tensor)]
    if f.seq_lens is not None:
        want = {k: v for k, v in {"S": 1, r: 1, t: -1}.items() if k is not None}
        ok = rows_and_keys and b in ("b", None) and not tensors and f.coef == want
        if not (ok and same(f.const, -Q)):
            raise Refused("arange mask is not t <= seq_len - Q + r")
        return f.seq_lens
    want = {k: v for k, v in {r: 1, t: -1}.items() if k is not None}
    scalars = sum((k * meta(n) for n, k in f.terms if n not in tensors), 0)
    literal = known_int(f.const - scalars)
    if not (rows_and_keys and b is None and f.coef == want and literal is not None):
        raise Refused("arange mask is not t <= c + r (every request holding c + Q tokens)")
    if not tensors and statically_known_true(f.const + Q > T):  # rows see every key
        raise Refused(f"the mask's requests hold {f.const + Q} tokens, more than the {T} keys")
    if not tensors and statically_known_true(f.const < 0):  # the first rows see no key
        raise Refused(f"the mask's requests hold {f.const + Q} tokens, fewer than its {Q} rows")
    q = 1 if r is None else [a for a in aranges[r].args if not isinstance(a, torch.dtype)][-1]
    return Offset(literal, f.terms, q)
