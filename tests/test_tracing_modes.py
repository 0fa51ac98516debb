"""The library behaves the same before and after any tracing (issue 13): a Python float scale
becomes a tensor through a per-device cache, and that cache must never hand a tensor made under
one mode (FakeTensorMode, make_fx, torch.export) to a call under another. Both directions used
to fail: a float scale first seen under FakeTensorMode cached a FakeTensor that later eager
calls received, and a real cached tensor made a later fake call raise "Please convert all
Tensors to FakeTensors first"."""

import pytest
import torch
from problems import make_problem, op_args
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torch_sm70attn as sa
from torch_sm70attn import reference

KS, VS = 0.5, 0.25


@pytest.fixture(autouse=True)
def fresh_scale_cache():
    sa._scale_tensor.cache_clear()
    yield
    sa._scale_tensor.cache_clear()


@pytest.fixture
def problem():
    return make_problem(B=2, H_kv=1, G=2, Q=2, D=64, lens=[20, 37])


def tensors(p):
    return op_args(p)[:5]


def want(p):
    args = list(op_args(p))
    args[6] = torch.tensor(KS)
    args[7] = torch.tensor(VS)
    return reference.paged_attention(*args)


def call(*args):
    return sa.paged_attention(*args, k_scale=KS, v_scale=VS)


def check_real(out, p):
    assert type(out) is torch.Tensor and not isinstance(out, FakeTensor)
    assert torch.equal(out, want(p))


def test_a_float_scale_first_seen_under_fake_mode_then_eager(problem):
    with FakeTensorMode() as mode:
        fake = call(*(mode.from_tensor(t) for t in tensors(problem)))
    assert isinstance(fake, FakeTensor) and fake.shape == problem["query"].shape
    check_real(call(*tensors(problem)), problem)


def test_eager_then_the_same_float_scale_under_fake_mode(problem):
    check_real(call(*tensors(problem)), problem)
    with FakeTensorMode() as mode:
        fake = call(*(mode.from_tensor(t) for t in tensors(problem)))
    assert isinstance(fake, FakeTensor) and fake.shape == problem["query"].shape
    check_real(call(*tensors(problem)), problem)  # and the cache still serves eager calls


@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_make_fx_between_eager_calls(problem, tracing_mode):
    check_real(call(*tensors(problem)), problem)
    gm = make_fx(call, tracing_mode=tracing_mode)(*tensors(problem))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.sm70attn.paged_attention.default in ops
    check_real(gm(*tensors(problem)), problem)
    check_real(call(*tensors(problem)), problem)


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_between_eager_calls(problem, strict):
    """The case as first reported: export of a module with float scales, then eager calls
    with the same floats (on torch 2.13 export's tracing counts as compiling, which bypasses
    the cache anyway; the fake-mode tests above are where the bug showed here)."""

    class M(torch.nn.Module):
        def forward(self, *args):
            return call(*args)

    ep = torch.export.export(M(), tensors(problem), strict=strict)
    check_real(M()(*tensors(problem)), problem)
    check_real(ep.module()(*tensors(problem)), problem)


def test_store_kv_float_scales_across_fake_mode():
    key = torch.randn(3, 1, 64).half()
    kc = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([0, 5, 17])
    with FakeTensorMode() as mode:
        fk, fc = mode.from_tensor(key), mode.from_tensor(kc)
        sa.store_kv(fk, fk, fc, mode.from_tensor(kc), mode.from_tensor(slots), k_scale=KS)
    vc = torch.zeros_like(kc)
    sa.store_kv(key, key, kc, vc, slots, k_scale=KS)
    assert type(kc) is torch.Tensor
    stored = kc.view(-1, 1, 64)[slots].float()
    assert torch.equal(stored, (key.float() / KS).to(torch.float8_e4m3fn).float())
