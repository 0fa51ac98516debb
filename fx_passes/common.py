"""Pieces shared by the sm70attn FX passes: node metadata, refusals, new-node helpers."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import guard_int, guard_or_false, statically_known_true

FP8 = torch.float8_e4m3fn


class Refused(Exception):
    """A step the pass cannot prove; the message is the logged reason, `fix` what the user
    can change in their model so that the rewrite applies (shown in the warning)."""

    def __init__(self, why: str, fix: str | None = None):
        super().__init__(why)
        self.fix = fix


def meta(node):
    """Fake value of a node (Dynamo: example_value; AOT graphs: val)."""
    if not isinstance(node, fx.Node):
        return node
    v = node.meta.get("example_value", node.meta.get("val"))
    if v is None:
        raise Refused(f"no fake-tensor metadata on {node.name}")
    return v


def target_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return t.overloadpacket.__name__
        return getattr(t, "__name__", str(t))
    return node.op


def arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


# --- sizes: ints, or SymInts under dynamic shapes -------------------------------------------
# Comparisons of sizes must not add guards (a guard on the batch size would recompile the
# model for every batch): `same` asks whether equality is provable from what the shape
# environment already knows. Only sizes the op needs as constants (head dim, page size, KV
# heads, group size) are made static, with `static`, once the rewrite is decided.
def val(x):
    """An argument's value: a node's fake value (a SymInt for a size node), else x itself."""
    return meta(x) if isinstance(x, fx.Node) else x


def same(a, b) -> bool:
    """a == b provably (ints or SymInts), without adding a guard."""
    return statically_known_true(a == b)


def agree(a, b) -> bool:
    """a == b, proven, or true now and guarded on (Dynamo recompiles if it stops holding).
    For sizes that eager code needs equal anyway, such as the tokens and slots of a write."""
    return same(a, b) or guard_or_false(a == b)


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


def one(x) -> bool:
    return statically_known_true(x == 1)


def known_int(x) -> int | None:
    """x as an int if it is one or the shape environment has fixed it (no guard added)."""
    if isinstance(x, int):
        return x
    e = x.node.shape_env.replace(x.node.expr)
    return int(e) if e.is_number else None


def static(x) -> int:
    """x as an int; a SymInt is specialized to its current value (Dynamo guards on it, so
    another value recompiles). For sizes that do not change in a serving loop."""
    return x if isinstance(x, int) else guard_int(x)


def shape(node) -> list:
    return list(meta(node).shape)


def scale_node(graph: fx.Graph, scale, device) -> fx.Node:
    """The op's k_scale / v_scale: a float32 tensor of shape [] or [H_kv] on `device`, from
    None (1.0), a Python number, or a scale tensor node of one or H_kv elements."""
    if scale is None or isinstance(scale, (int, float)):
        value = 1.0 if scale is None else float(scale)
        full = graph.call_function(
            torch.full, ((), value), {"dtype": torch.float32, "device": device}
        )
        return fake(full)
    flat = fake(graph.call_method("reshape", (scale, (-1,))))
    return fake(graph.call_method("to", (flat,), {"device": device, "dtype": torch.float32}))


def fake(node: fx.Node) -> fx.Node:
    """Fill a new node's example_value by running it on its inputs' fake values, in the
    graph's fake mode (a node without tensor inputs takes it from the placeholders)."""
    modes = [v.fake_mode for v in map(meta, node.all_input_nodes) if isinstance(v, FakeTensor)]
    if not modes:  # e.g. torch.full: take the mode of the graph's inputs
        vals = (n.meta.get("example_value") for n in node.graph.nodes if n.op == "placeholder")
        modes = [v.fake_mode for v in vals if isinstance(v, FakeTensor)]
    mode = modes[0] if modes else FakeTensorMode()
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), meta)
    fn = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
    with mode:
        node.meta["example_value"] = fn(*args, **kwargs)
    return node


def erase_dead(graph: fx.Graph, roots) -> None:
    """Erase `roots` and, transitively, the pure nodes that fed only them."""
    work = list(roots)
    while work:
        n = work.pop()
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function", "call_method"):
            continue
        name = target_name(n)
        if n not in roots and (name.endswith("_") or name in ("setitem", "index_put", "copy")):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(inputs)


# --- aliasing and mutation (pre-grad graphs are not functional) ------------------------------
VIEWS = {
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "_unsafe_view",
    "transpose",
    "swapaxes",
    "t",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "getitem",
    "select",
    "narrow",
    "as_strided",
    "contiguous",
    "view_as",
    "alias",
    "detach",
    "split",
    "chunk",
    "unbind",
    "getattr",  # x.T, x.mT
    "movedim",
    "diagonal",
}
# operator.iadd and friends: Dynamo's form of `x += y`, in place on a tensor
IN_PLACE_OPERATORS = {
    getattr(operator, f"i{n}")
    for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
    + ("lshift", "rshift", "matmul")
}


CONVERSIONS = {"to", "long", "int", "half", "float", "double", "type", "type_as", "bool"}


def _aliases_its_input(node: fx.Node) -> bool:
    """A view, or a conversion to the dtype its input already has (which returns the input)."""
    name = target_name(node)
    if name in VIEWS:
        return True
    if name not in CONVERSIONS or not isinstance(node.args[0], fx.Node):
        return False
    a, b = node.meta.get("example_value"), node.args[0].meta.get("example_value")
    # unknown dtypes: assume the alias (more refusals, never a missed write)
    return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype == b.dtype


def root(node):
    """The tensor a (possible) view was taken from: follows view-like ops, and conversions
    that return their input, to their source."""
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method"):
        if not node.args or not _aliases_its_input(node):
            break
        node = node.args[0]
    return node


def mutated_roots(node: fx.Node) -> list | None:
    """Roots of what `node` writes; [] if it writes nothing; None if it may write anything."""
    if node.op not in ("call_function", "call_method"):
        return []
    t = node.target
    if t is operator.setitem:
        return [root(node.args[0])]
    if t in IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True:  # x += y; F.relu(x, True)
        return [root(node.args[0])] if node.args and isinstance(node.args[0], fx.Node) else []
    if isinstance(t, torch._ops.OpOverloadPacket):  # torch.ops.ns.op(...): any overload's writes
        schemas = (getattr(t, o)._schema for o in t.overloads())
        writes = any(
            a.alias_info is not None and a.alias_info.is_write
            for sc in schemas
            for a in sc.arguments
        )
        return None if writes else []
    if isinstance(t, torch._ops.OpOverload):
        return [
            root(node.args[i] if i < len(node.args) else node.kwargs[a.name])
            for i, a in enumerate(t._schema.arguments)
            if a.alias_info is not None
            and a.alias_info.is_write
            and (i < len(node.args) or a.name in node.kwargs)
        ]
    name = target_name(node)
    if name.endswith("_") and not name.startswith("_") and node.args:
        return [root(node.args[0])]  # in-place method (add_, copy_, index_put_, ...)
    if node.kwargs.get("out") is not None:
        return None
    return []


def writes_between(start: fx.Node, end: fx.Node, tensors) -> str | None:
    """Why a node strictly between `start` and `end` may write one of `tensors` (or their
    views), or None. A rewrite that moves reads of them to `end` is sound only without."""
    roots = {root(x) for x in tensors if isinstance(x, fx.Node)}
    n = start.next
    while n is not end and n.op != "root":
        hit = mutated_roots(n)
        if hit is None or roots.intersection(hit):
            return f"{n.name} may write {sorted(r.name for r in roots)} before it is read"
        n = n.next
    return None
