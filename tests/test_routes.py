"""The route rule (torch_sm70attn/routes.py: RULES) on the CPU: admit on one case per rule and
per tensor (tests/problems.py: ROUTE_CASES; tests/test_cuda.py runs the same cases through the
binding), the binding's rules named in the table's order, and the reason of a call the binding
refused worded from the table."""

import re
import warnings
from pathlib import Path

import pytest
import torch
from problems import ROUTE_CASES, make_problem, op_args, route_case_problem
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_sm70attn as sa
from torch_sm70attn import ops, reference, routes

BINDING = Path(__file__).resolve().parents[1] / "csrc" / "binding"
ROUTE, OPS = BINDING / "route.h", BINDING / "ops.h"
NAMES = [r.name for r in routes.RULES]
BY_NAME = {r.name: r for r in routes.RULES}


def test_every_rule_has_a_case_and_every_case_a_rule():
    rules = {case[1] for case in ROUTE_CASES}
    assert rules == {"admitted", *NAMES}
    for rule in routes.RULES:
        assert rule.tensor in ("", "query", "key_cache", "value_cache", "block_table"), rule
        assert rule.by in ("op", "python", "binding"), rule
    assert len({case[0] for case in ROUTE_CASES}) == len(ROUTE_CASES)


def test_the_binding_names_its_rules_in_the_tables_order():
    """The binding decides the route of a CUDA call: route_refusal returns the name of the first
    rule failed, which ops.cuda_fallback words from the table."""
    body = re.search(r"const char\* route_refusal\(.*?\n\}\n", ROUTE.read_text(), re.S)
    assert body, "route_refusal not found in csrc/binding/route.h"
    named = re.findall(r'return "([^"]+)";', body[0])
    assert named == [r.name for r in routes.RULES if r.by == "binding"]
    ops_src = OPS.read_text()
    assert "route_refusal(query, key_cache, value_cache," in ops_src
    assert "v_scale, rule)" in ops_src  # the rule's name handed to the fallback


def _fake_cuda(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake CUDA tensor of t's dtype, shape, strides and storage offset."""
    with mode:
        n = t.untyped_storage().nbytes() // t.element_size()
        base = torch.empty(n, dtype=t.dtype, device="cuda")
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("case", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_admit_route_and_reason(case, monkeypatch):
    """admit as the FX pass asks it (fake CUDA tensors, a V100's compute capability): the route
    and the reason of the first rule the case fails."""
    label, want_rule, _, _ = case
    monkeypatch.delenv("TORCH_SM70ATTN_DISABLE", raising=False)
    if want_rule == "TORCH_SM70ATTN_DISABLE":
        monkeypatch.setenv("TORCH_SM70ATTN_DISABLE", "1")
    cc = (6, 1) if want_rule == "compute capability" else (7, 0)
    monkeypatch.setattr(routes, "_CAPABILITY", {0: cc})
    p = route_case_problem(case)
    if want_rule != "device":
        mode = FakeTensorMode()
        p = {k: _fake_cuda(v, mode) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    q, kc, vc, bt = p["query"], p["key_cache"], p["value_cache"], p["block_table"]
    got = sa.admit(q, kc, bt, value_cache=vc)
    if want_rule == "admitted":
        assert got == (sa.CUDA, "admitted")
        return
    rule, why = routes.first_refusal(routes.Call(q, kc, vc, bt))
    assert rule.name == want_rule, (label, rule.name, why)
    if rule.by == "op":
        assert got == (sa.UNSUPPORTED, why + ": paged_attention raises TypeError")
    else:
        assert got == (sa.REFERENCE, why)
    if rule.name.split()[0] == rule.tensor:  # a rule of one tensor names it
        assert why.startswith(rule.tensor + " "), why
    if rule.by == "binding":  # the runtime reason of the binding's refusal: the same words
        assert routes.binding_reason(rule.name, routes.Call(q, kc, vc, bt)) == why


@pytest.mark.parametrize("case", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_the_op_serves_every_case_on_the_cpu(case, monkeypatch):
    """Every case but the op's own refusals (TypeError, naming the tensor) is computed: the
    reference the refused calls of the GPU take."""
    monkeypatch.delenv("TORCH_SM70ATTN_DISABLE", raising=False)
    p = route_case_problem(case)
    rule = routes.first_refusal(
        routes.Call(p["query"], p["key_cache"], p["value_cache"], p["block_table"])
    )
    assert rule is not None and rule[0].name in ("device", case[1])  # (on the CPU: device first)
    args = op_args(p)
    if case[1] in NAMES and BY_NAME[case[1]].by == "op":
        with pytest.raises(TypeError, match=BY_NAME[case[1]].tensor):
            torch.ops.sm70attn.paged_attention(*args)
        return
    out = torch.ops.sm70attn.paged_attention(*args)
    assert out.shape == p["query"].shape
    assert torch.equal(out, reference.paged_attention(*args))


def test_reason_words_from_the_table():
    """Each rule's wording, as admit, the FX pass and the fallback's warning give it."""
    q = torch.empty(1, 12, 17, 96, dtype=torch.float16)
    c = torch.empty(1, 16, 1, 96, dtype=torch.float8_e4m3fn)
    assert "head dim 96 not in (64, 128, 256)" == routes.shape_refusal(q, c)
    assert "group size H_q/H_kv = 12/1 not in" in routes.shape_refusal(q[..., :64], c[..., :64])
    assert "query rows 17 not in 1-16" == routes.shape_refusal(q[:, :4, :, :64], c[..., :64])
    assert routes.dtype_refusal(q.float(), c) == (
        "query dtype torch.float32 not in (torch.float16,)"
    )
    odd = torch.empty(1, 16, 1, 72, dtype=torch.float8_e4m3fn)[..., 1:65]
    assert routes.shape_refusal(q[:, :4, :1, :64], odd) == (
        "key_cache strides (1152, 72, 72, 1) / offset 1 not 8-byte aligned"
    )


def test_cuda_fallback_warns_the_binding_rule_in_the_tables_words(monkeypatch):
    """The Python half of the binding's refusal, on CPU tensors: the rule the binding names is
    worded by the table, warned once, and the reference computes the call."""
    monkeypatch.setattr(routes, "warned", set())
    monkeypatch.delenv("TORCH_SM70ATTN_DISABLE", raising=False)
    p = make_problem(B=2, H_kv=1, G=2, Q=1, D=96)
    args = op_args(p)
    for rule, want in (
        ("head dim", "head dim 96 not in (64, 128, 256)"),
        ("no such rule", "no such rule (the binding's check; admit, which sees only metadata,"),
    ):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = ops.cuda_fallback(*args, rule)
            ops.cuda_fallback(*args, rule)
        msgs = [str(x.message) for x in w if "reference route" in str(x.message)]
        assert len(msgs) == 1 and msgs[0].split("reference route: ")[1].startswith(want), msgs
        assert torch.equal(out, reference.paged_attention(*args))
