"""torch.compile on the GPU: the sm70attn backend with CUDA graphs, through inductor
(mode="reduce-overhead": cudagraph trees) and through the backend's own recorder
(options={"inner": "cudagraphs"}, the V100's path: the graph in place, no AOT): no skips, one
recording per batch bucket, replays with new lengths and block tables equal to eager."""

import copy
import functools

import helpers_models
import pytest
import torch
from oracle import rel_err
from torch._dynamo.utils import counters

import torch_sm70attn  # noqa: F401
from torch_sm70attn.backend import pad_batch

pytestmark = pytest.mark.cuda
DEV = "cuda"


def Served(P, ps):
    """The toy decoder with its paged caches as buffers (static inputs of the graphs)."""
    return helpers_models.Served(P=P, ps=ps, H=2, D=128, G=6, dim=256)


def step_inputs(B, Q, ps, P, W, gen):
    return helpers_models.step_inputs(B, W, Q, gen, dim=256, ps=ps, P=P)


def recorded(how: str, recordings) -> tuple[int, int]:
    """(CUDA graphs recorded, skips) of the path `how`."""
    if how == "reduce-overhead":
        return len(recordings), counters["inductor"]["cudagraph_skips"]
    c = counters["sm70attn"]
    return c["cuda_graph_recordings"], c["cuda_graph_skips"]


def compile_kw(how: str) -> dict:
    """torch.compile arguments of the two CUDA-graph paths: inductor and AOT-eager."""
    if how == "reduce-overhead":
        return dict(mode="reduce-overhead")
    return dict(options={"inner": "cudagraphs"})


@pytest.fixture
def recordings(monkeypatch):
    """The function ids cudagraph trees record a CUDA graph for, in order (inductor's path;
    the backend's recorder counts counters["sm70attn"]["cuda_graph_recordings"])."""
    from torch._inductor import cudagraph_trees

    seen = []
    orig = cudagraph_trees.CUDAGraphTreeManager.record_function

    @functools.wraps(orig)
    def counting(self, new_inputs, function_id):
        seen.append(function_id)
        return orig(self, new_inputs, function_id)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counting)
    return seen


@pytest.mark.parametrize("how", ["reduce-overhead", "inner-cudagraphs"])
def test_cudagraph_trees_buckets_and_replays(how, recordings, record):
    torch.manual_seed(0)
    Q, ps, P, W = 4, 16, 64, 6
    model = Served(P, ps).to(DEV).eval()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    kw = compile_kw(how)
    compiled = torch.compile(model, backend="sm70attn", fullgraph=True, dynamic=False, **kw)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    with torch.no_grad():
        for B in (1, 2, 3, 4, 1, 2, 3, 4, 4, 1):  # buckets 1, 2, 4; each replayed with new inputs
            x, bt, sl, slots = step_inputs(B, Q, ps, P, W, gen)
            want = eager(x.to(DEV), bt.to(DEV), sl.to(DEV), slots.reshape(-1).to(DEV))
            xp, btp, slp, _ = pad_batch(x, bt, sl)
            pad = xp.shape[0] - B
            slots_p = torch.cat([slots, slots.new_full((pad, Q), -1)]).reshape(-1)
            got = compiled(xp.to(DEV), btp.to(DEV), slp.to(DEV), slots_p.to(DEV))[:B]
            worst = max(worst, rel_err(got, want.double()))
    assert counters["sm70attn"]["paged_attention_rewrite"] == 2 * 3  # 2 layers x 3 buckets
    assert counters["sm70attn"]["store_kv_rewrite"] == 2 * 3
    n, skips = recorded(how, recordings)
    assert skips == 0 and n == 3, (n, skips)
    assert worst < 1e-2, worst
    record(f"compile {how}", worst, f"{n} recordings, {skips} cudagraph skips")


# The serving loop of tests/test_serving_loop.py on the GPU: batch and table width change from
# step to step (decode, then verify with changing query rows), Dynamo's automatic dynamic
# shapes, CUDA graphs. Every compiled graph rewrites both layers; no cudagraph skips.
LOOP = [(2, 3, 1), (3, 3, 1), (4, 5, 1), (5, 2, 1), (2, 6, 1), (3, 3, 4), (4, 5, 4), (2, 6, 8)]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("how", ["reduce-overhead", "inner-cudagraphs"])
def test_serving_loop_dynamic_shapes_with_cuda_graphs(how, padded, recordings, monkeypatch, record):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)  # a graph per shape
    torch.manual_seed(0)
    ps, P = 16, 64
    model = Served(P, ps).to(DEV).eval()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    kw = compile_kw(how)
    compiled = torch.compile(model, backend="sm70attn", fullgraph=True, **kw)
    gen = torch.Generator().manual_seed(2)
    worst, shapes = 0.0, set()
    with torch.no_grad():
        for B, W, Q in LOOP * 2:  # cudagraph trees record a shape when it comes again
            x, bt, sl, slots = step_inputs(B, Q, ps, P, W, gen)
            want = eager(x.to(DEV), bt.to(DEV), sl.to(DEV), slots.reshape(-1).to(DEV))
            if padded:  # batch buckets 1, 2, 4, 8; the table padded to 8 pages
                x, bt, sl, _ = pad_batch(x, bt, sl, width=8)
                slots = torch.cat([slots, slots.new_full((x.shape[0] - B, Q), -1)])
            shapes.add((x.shape[0], bt.shape[1], Q))
            got = compiled(x.to(DEV), bt.to(DEV), sl.to(DEV), slots.reshape(-1).to(DEV))[:B]
            worst = max(worst, rel_err(got, want.double()))
    graphs = counters["stats"]["unique_graphs"]
    c = counters["sm70attn"]
    assert c["paged_attention_rewrite"] == 2 * graphs and not c.get("sdpa_refused"), dict(c)
    assert c["store_kv_rewrite"] == 2 * graphs and not c.get("store_refused"), dict(c)
    n, skips = recorded(how, recordings)
    assert skips == 0
    # One recording per shape at most: a shape is recorded when it comes again to the same
    # compiled graph (a recompile for a dynamic size starts a graph anew).
    assert 0 < n <= len(shapes), (n, shapes)
    assert worst < 1e-2, worst
    record(
        f"loop {how}{' padded' if padded else ''}",
        worst,
        f"{len(LOOP)} steps, {graphs} graphs, {n} recordings, {skips} skips",
    )


def test_recorder_writes_the_cache_in_place(record):
    """The backend's recorder (the V100's reduce-overhead) runs store_kv in place: compiling,
    recording and replaying a step over a 4 GiB paged cache allocates nothing near its size
    (through AOT-eager, functionalization cloned the whole cache at every store), and the
    replay writes the same bytes and returns the same attention as eager."""
    P, ps, H, D, B, Q = 131072, 16, 8, 128, 4, 8  # 2 GiB per cache
    kc = torch.zeros(P, ps, H, D, dtype=torch.float8_e4m3fn, device=DEV)
    vc = torch.zeros_like(kc)
    gen = torch.Generator(device=DEV).manual_seed(0)
    bt = torch.randperm(P, device=DEV, generator=gen)[: B * 64].view(B, 64).int()
    sl = torch.full((B,), 1000, dtype=torch.int32, device=DEV)

    def step(q, k, v, kc, vc, slots):
        torch_sm70attn.store_kv(k, v, kc, vc, slots)
        return torch_sm70attn.paged_attention(q, kc, vc, bt, sl)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="sm70attn", fullgraph=True, **compile_kw("inner"))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(3):  # warm-up, record, replay: each a new step's tokens
        q = torch.randn(B, H * 6, Q, D, device=DEV, generator=gen).half()
        k, v = (torch.randn(B * Q, H, D, device=DEV, generator=gen).half() for _ in "kv")
        pos = (sl[:, None] - Q + torch.arange(Q, device=DEV)).long()
        slots = (bt.gather(1, pos // ps).long() * ps + pos % ps).reshape(-1)
        got = compiled(q, k, v, kc, vc, slots)
        want = torch_sm70attn.paged_attention(q, kc, vc, bt, sl)  # eager, over what it stored
        assert torch.equal(got, want), i
        page, off = bt.gather(1, pos // ps).long().reshape(-1), (pos % ps).reshape(-1)
        small = torch.zeros(B * Q // ps, ps, H, D, dtype=kc.dtype, device=DEV)
        torch_sm70attn.store_kv(k, v, small, small.clone(), torch.arange(B * Q, device=DEV))
        assert torch.equal(kc[page, off].view(torch.uint8), small.flatten(0, 1).view(torch.uint8))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert counters["sm70attn"]["cuda_graph_recordings"] == 1
    assert extra < 2**28, f"{extra / 2**30:.2f} GiB allocated beyond the caches"
    record("recorder in place", 0.0, f"peak {extra / 2**20:.0f} MiB over a 4 GiB cache")
