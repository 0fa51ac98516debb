"""The backend's CUDA-graph recorder (torch_sm70attn/cudagraphs.py) on the CPU: which inputs of
a Dynamo graph it uses in place (static ones, and those the graph writes, through a view too),
and that a graph it cannot record runs eagerly, counted as a skip. Recording and replay run in
tests/test_compile_cuda.py."""

import torch
from helpers_cudagraphs import emulated
from torch._dynamo.utils import counters

import torch_sm70attn as sa
from torch_sm70attn import cudagraphs


class Writes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x, marked, arg, kc, vc, slots, untouched):
        self.buf.add_(1)  # a buffer: static, and written
        arg[0].add_(1)  # written through a view
        marked.mul_(2)  # static (mark_static_address) and written
        k = x[:, None, :].expand(-1, 2, -1).half().contiguous()
        sa.store_kv(k, k, kc, vc, slots)  # the caches: written by the op
        return self.lin(x) + self.buf + untouched


def graph_of(fn, *args):
    seen = {}

    def backend(gm, example_inputs):
        names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        seen["static"] = {names[i] for i in cudagraphs.static_inputs(gm.graph)}
        seen["written"] = {names[i] for i in cudagraphs.written_inputs(gm.graph)}
        seen["run"] = cudagraphs.graphed(gm, example_inputs)
        return seen["run"]

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen, out


def test_inputs_used_in_place():
    marked = torch.ones(3)
    torch._dynamo.mark_static_address(marked)
    kc = torch.zeros(4, 16, 2, 4, dtype=torch.float8_e4m3fn)
    args = (torch.randn(2, 4), marked, torch.zeros(2, 3), kc, kc.clone())
    args += (torch.tensor([0, 17]), torch.ones(4))
    counters.clear()
    seen, out = graph_of(Writes(), *args)
    static, written = seen["static"], seen["written"]  # placeholder names, e.g. "l_kc_"

    def names(found, *parts):
        return all(sum(p in n for n in found) == 1 for p in parts) and len(found) == len(parts)

    assert names(static, "buf", "marked", "weight", "bias"), static
    assert names(written, "buf", "arg", "marked", "kc", "vc"), written
    # on the CPU no CUDA graph: the graph runs eagerly, once counted as a skip
    assert counters["sm70attn"]["cuda_graph_skips"] == 1
    assert marked.tolist() == [2.0] * 3 and args[2][0].tolist() == [1.0] * 3
    assert kc.view(torch.uint8)[1, 1].any()  # slot 17: page 1, offset 1
    assert out.shape == (2, 4)


def test_writes_in_other_forms_are_found():
    """x += y, inplace=True, a write through .contiguous() / a same-dtype .to(), and the op
    called through its packet (torch.ops.sm70attn.store_kv): each input is written."""

    def fn(a, b, c, d, kc, vc, k, slots, s, read):
        a += 1
        torch.nn.functional.relu(b, inplace=True)
        c.contiguous().add_(1)
        d.to(torch.float32).mul_(2)
        torch.ops.sm70attn.store_kv(k, k, kc, vc, slots, s, s)
        return read * 2

    kc = torch.zeros(2, 16, 2, 4, dtype=torch.float8_e4m3fn)
    k = torch.ones(2, 2, 4).half()
    args = [torch.zeros(3) for _ in range(4)] + [kc, kc.clone(), k, torch.tensor([0, 1])]
    args += [torch.tensor(1.0), torch.ones(3)]
    seen, _ = graph_of(fn, *args)
    written = seen["written"]
    assert {"l_a_", "l_b_", "l_c_", "l_d_", "l_kc_", "l_vc_"} <= written, written
    assert "l_read_" not in written  # the packet's call counts as writing its inputs, only


def step(cache, lens, x):
    """A decode step's shape: writes a cache row and advances a length in place."""
    cache.index_copy_(0, lens.view(1), x.view(1, -1))
    lens.add_(1)
    return (cache.sum(0) * 2,)


def test_recorder_warms_records_replays(monkeypatch):
    """On the CPU with an emulated graph: call 1 eager, call 2 recorded (and run), calls 3+
    replayed; the cache and length the graph writes are the caller's (in place), the input x
    is copied in, outputs are fresh tensors each call; results equal eager's throughout."""
    emulated(monkeypatch)
    counters.clear()
    gm = torch.fx.symbolic_trace(step)
    run = cudagraphs.graphed(gm, [torch.zeros(8, 4), torch.tensor(0), torch.zeros(4)])
    cache, lens = torch.zeros(8, 4), torch.tensor(0)
    ref_cache, ref_lens = cache.clone(), lens.clone()
    outs = []
    for i in range(5):
        x = torch.full((4,), float(i + 1))
        (got,) = run(cache, lens, x)
        (want,) = step(ref_cache, ref_lens, x)
        assert torch.equal(got, want) and torch.equal(cache, ref_cache) and lens == ref_lens, i
        outs.append((got, want))
    assert counters["sm70attn"]["cuda_graph_recordings"] == 1
    # each call's output is its own: later replays did not overwrite earlier outputs
    assert all(torch.equal(got, want) for got, want in outs)
    assert len({got.untyped_storage().data_ptr() for got, _ in outs}) == len(outs)


def test_recorder_failed_capture_and_autograd_run_eagerly(monkeypatch):
    emulated(monkeypatch, fail=True)
    counters.clear()
    gm = torch.fx.symbolic_trace(step)
    run = cudagraphs.graphed(gm, [torch.zeros(8, 4), torch.tensor(0), torch.zeros(4)])
    cache, lens = torch.zeros(8, 4), torch.tensor(0)
    for _ in range(3):
        run(cache, lens, torch.ones(4))
    assert lens == 3 and counters["sm70attn"]["cuda_graph_skips"] == 1  # failed once, eager
    emulated(monkeypatch)
    w = torch.ones(4, requires_grad=True)
    gm = torch.fx.symbolic_trace(lambda w, x: (w * x,))
    run = cudagraphs.graphed(gm, [w, torch.ones(4)])
    for _ in range(3):
        (y,) = run(w, torch.ones(4))
        y.sum().backward()
    assert torch.equal(w.grad, torch.full((4,), 3.0))
    assert counters["sm70attn"]["cuda_graph_recordings"] == 0
