"""The paging core without a model: the slot table (allocation, a step's lengths and slots
with padding and overflow, crop, beam reorder, one request's view, a compiled step), the
scales (checked, shaped, calibrated, saturation counted) and a cache's pager (a step's plan
across layers, the host checks and refusals, crop counts, one request's pager)."""

import warnings

import pytest
import torch

from torch_sm70attn import paging
from torch_sm70attn.manifest import admitted_capacity, contract

PS = 4


def general_slots(table, lens, rows, ps=PS):
    """Slots of each request's last `rows` tokens through any table: page table[b, p // ps],
    offset p % ps."""
    pos = lens[:, None].long() - rows + torch.arange(rows)
    return (table.gather(1, pos // ps).long() * ps + pos % ps).flatten()


def test_a_batch_gets_consecutive_pages_and_empty_requests():
    st = paging.SlotTable(3, paging.SlotTable.width(10, 3, PS), PS, "cpu")
    assert st.table.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert st.table.dtype == st.lens.dtype == torch.int32
    assert st.lens.tolist() == [0, 0, 0] and not st.full.any() and not st.astray.any()
    assert (st.batch, st.capacity, st.limit, st.device) == (3, 12, 12, torch.device("cpu"))
    # a request's pages never exceed the capacity the kernels admit
    assert paging.SlotTable.width(10**9, 1, 16) == admitted_capacity(16) // 16
    assert paging.SlotTable(1, admitted_capacity(16) // 16, 16, "cpu").limit == contract()
    assert paging.SlotTable.width(2, 3, PS) == 0


def test_a_step_with_left_padding_stores_the_real_tokens_only():
    st = paging.SlotTable(2, 3, PS, "cpu")
    valid = torch.tensor([[False, False, True, True, True], [True] * 5])
    st.advance(5, valid)
    assert st.lens.tolist() == [3, 5]
    plan = st.plan(5, valid, pages=2)
    assert plan.table is st.table and plan.lens is st.lens and plan.valid is valid
    assert (plan.rows, plan.pages) == (5, 2)
    # request 0: padding -1, then positions 0..2 of pages 0..; request 1: positions 0..4 of
    # pages 3, 4 (slots 12..16)
    assert plan.slots.tolist() == [-1, -1, 0, 1, 2, 12, 13, 14, 15, 16]
    st.advance(2)  # a verify step of 2 rows, no padding: what any table gives
    assert st.lens.tolist() == [5, 7]
    assert torch.equal(st.slots(2), general_slots(st.table, st.lens, 2))


def test_a_step_past_the_pages_is_flagged_and_stores_nothing():
    st = paging.SlotTable(2, 2, PS, "cpu")  # 8 tokens a request
    st.advance(6, torch.tensor([[False, False, True, True, True, True], [True] * 6]))
    st.advance(3)  # request 1: 9 > 8
    assert st.lens.tolist() == [7, 8] and st.full.tolist() == [False, True]
    assert st.slots(3).tolist() == [4, 5, 6, -1, -1, -1]  # a full request stores nothing
    assert st.flags() == ([False, True], [False, False]) == st.poll()  # (the CPU: no copy)
    st.advance(1)
    assert st.lens.tolist() == [8, 8] and st.full.tolist() == [False, True]  # stays at the limit
    st.clear_flags()
    assert not st.full.any()


def test_a_step_not_starting_at_a_requests_length_is_flagged_astray():
    st = paging.SlotTable(2, 2, PS, "cpu")
    st.advance(3, starts=torch.tensor([0, 0]))
    st.advance(1, starts=torch.tensor([3, 1]))  # request 1 holds 3: its token is not at 3
    assert st.astray.tolist() == [False, True] and st.lens.tolist() == [4, 4]
    st.reset()
    assert st.lens.tolist() == [0, 0] and not st.astray.any() and not st.full.any()


def test_crop_per_request_and_for_all():
    st = paging.SlotTable(3, 2, PS, "cpu")
    st.advance(6)
    st.crop(torch.tensor([2, 0, 7], dtype=torch.int32))
    assert st.lens.tolist() == [4, 6, 0]  # never below 0
    st.crop(1)
    assert st.lens.tolist() == [3, 5, 0]
    # the next step writes over the removed tokens
    st.advance(1)
    assert st.slots(1).tolist() == [3, 8 + 5, 16]


def test_the_tensors_stay_in_place_and_offsets_are_kept_per_width():
    st = paging.SlotTable(2, 3, PS, "cpu")
    tensors = [st.table, st.lens, st.full, st.astray]
    for rows in (5, 1, 1, 4, 1):
        st.advance(rows)
        assert torch.equal(st.slots(rows), general_slots(st.table, st.lens, rows))
    st.crop(torch.tensor([1, 2], dtype=torch.int32))
    st.reset()
    assert all(
        a is b for a, b in zip(tensors, [st.table, st.lens, st.full, st.astray], strict=True)
    )
    assert st.offsets(4) is st.offsets(4)  # made once per width, outside a compiled graph
    assert torch.equal(
        paging.contiguous_slots(st.table, st.lens + 4, 4, PS),
        general_slots(st.table, st.lens + 4, 4),
    )


def test_one_requests_view_changes_that_request_only():
    st = paging.SlotTable(3, 2, PS, "cpu")
    st.advance(3)
    view = st.request(1)
    assert (view.batch, view.first, view.table.tolist()) == (1, 1, [[2, 3]])
    assert view.lens.data_ptr() == st.lens[1:].data_ptr()
    view.reset()
    view.advance(5)
    assert st.lens.tolist() == [3, 5, 3]
    assert view.slots(5).tolist() == list(range(8, 13))
    view.advance(4)  # past its 8 tokens: its flag, here
    assert st.full.tolist() == [False, True, False] and st.lens.tolist() == [3, 8, 3]
    assert view.request(0).first == 1


def test_beam_reorder_copies_the_pages_in_use():
    st = paging.SlotTable(2, 2, PS, "cpu")
    pool = torch.arange(4 * PS * 2, dtype=torch.uint8).view(4, PS, 2).view(torch.float8_e4m3fn)
    st.advance(5, torch.tensor([[True] * 5, [False, True, True, True, True]]))
    st.full[0] = True
    before = pool.view(torch.uint8).clone()
    st.reorder(torch.tensor([0, 0]), [pool])  # both continue request 0
    got = pool.view(torch.uint8)
    assert torch.equal(got[2:4], before[0:2]) and torch.equal(got[0:2], before[0:2])
    assert st.lens.tolist() == [5, 5] and st.full.tolist() == [True, True]


def test_a_compiled_step_has_no_graph_break_and_writes_in_place():
    st = paging.SlotTable(2, 3, PS, "cpu")

    def step(valid):
        st.advance(valid.shape[1], valid)
        return st.plan(valid.shape[1], valid).slots

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    valid = torch.tensor([[True, True], [False, True]])
    lens = st.lens
    got = compiled(valid)
    assert st.lens is lens and st.lens.tolist() == [2, 1]
    assert got.tolist() == [0, 1, -1, 12]
    offsets = st.offsets(2)  # not the graph's: nothing was kept from inside it
    assert compiled(valid).tolist() == [2, 3, -1, 13] and st.offsets(2) is offsets


# --- scales ----------------------------------------------------------------------------------
def test_scales_are_checked_once_per_layer():
    assert paging.per_layer_scales(None, 3, "k_scale") == [None] * 3
    assert paging.per_layer_scales(0.5, 2, "k_scale") == [0.5, 0.5]
    assert paging.per_layer_scales([0.5, torch.tensor([1.0, 2.0])], 2, "k_scale")[0] == 0.5
    with pytest.raises(ValueError, match=r"k_scale is a list of 3; a list holds one scale per"):
        paging.per_layer_scales([0.5] * 3, 2, "k_scale")
    with pytest.raises(ValueError, match=r"v_scale must be finite and > 0, got \[1.0, -1.0\]"):
        paging.per_layer_scales([0.5, torch.tensor([1.0, -1.0])], 2, "v_scale")
    with pytest.raises(ValueError, match="finite"):
        paging.per_layer_scales(float("inf"), 2, "v_scale")


def test_a_scale_on_the_device_is_float32_per_kv_head():
    s = paging.device_scale(0.25, 3, "cpu")
    assert s.dtype == torch.float32 and s.tolist() == [0.25] * 3 and s.is_contiguous()
    assert paging.device_scale(torch.tensor([1.0, 2.0]), 2, "cpu").tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="1 or H_kv=3 values"):
        paging.device_scale(torch.tensor([1.0, 2.0]), 3, "cpu")


def test_calibration_takes_the_real_tokens_amax_per_kv_head():
    x = torch.zeros(2, 3, 4, 8, dtype=torch.float16)
    x[0, 0, 0, 0] = -896.0  # padding: left out
    x[0, 0, 3, 1] = 224.0
    x[1, 1, 2, 5] = -44.8
    valid = torch.tensor([[False, True, True, True], [True] * 4])
    s = paging.calibrated_scale(x, valid, headroom=2.0)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, torch.tensor([1.0, 0.2, 1.0]), rtol=1e-3, atol=0)  # 0: 1
    assert paging.calibrated_scale(x, None, 1.0)[0] == 2.0


def test_saturation_is_counted_per_forward_and_said_once():
    sat = paging.Saturation()
    k = torch.tensor([1.0, 500.0, -449.0, 3.0]).view(1, 1, 4, 1).half()
    v = torch.ones(1, 1, 4, 1).half()
    one = torch.ones(1)
    sat.start(4)
    for _ in range(2):  # two layers
        sat.add(k, v, one, one)
    assert sat.read() and sat.saturated == [4, 0] and sat.counted == 8
    sat.start(3)
    sat.add(k, v, one, one, valid=torch.tensor([[True, False, True, True]]))
    assert not sat.read()  # said once
    assert sat.saturated == [5, 0] and sat.counted == 11
    assert sat.fractions() == [5 / 11, 0.0]
    sat.add(k, v, one, one)  # a forward that raised before its last layer
    sat.start(4)
    sat.add(k, v, torch.full((1,), 1.1), one)  # at scale 1.1: 500 saturates, 449 does not
    sat.read()
    assert sat.saturated == [6, 0]


# --- the pager ---------------------------------------------------------------------------------
def test_pager_plans_a_step_once_for_its_layers():
    cpu = torch.device("cpu")
    pg = paging.Pager(16 * PS, PS, 2)  # 8 pages a request of a batch of 2
    valid = torch.tensor([[False, True, True, True, True], [True] * 5])
    pos = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
    plan, tokens = pg.step(0, 3, 2, 5, valid, pos, cpu, reserve=2)  # the first: checked
    assert pg.slot_table.table.tolist() == [list(range(8)), list(range(8, 16))] and tokens == 9
    assert (plan.pages, pg.slot_table.lens.tolist()) == (None, [4, 5]) and pg.plan is plan
    assert pg.step(1, 3, 2, 5, valid, None, cpu)[0] is plan  # the eager step's other layers
    assert pg.step(2, 3, 2, 5, valid, None, cpu) == (plan, None) and pg.plan is None
    plan, tokens = pg.step(0, 1, 2, 1, None, None, cpu)  # a decode step: not checked
    assert tokens is None and pg.slot_table.lens.tolist() == [5, 6]
    plan, tokens = pg.step(0, 1, 2, 17, None, None, cpu)  # a prefill chunk: checked, its pages
    assert (plan.pages, tokens, pg.slot_table.lens.tolist()) == (6, 34, [22, 23])
    assert pg.length() == 23 and pg.limit() == 8 * PS


def test_pager_refuses_before_anything_is_stored():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="need page_size >= 1"):
        paging.Pager(2, PS, 1)
    pg = paging.Pager(4 * PS, PS, 2)
    with pytest.raises(ValueError, match="batch 3 > max_batch_size 2"):
        pg.step(0, 1, 3, 20, None, None, cpu)
    with pytest.raises(RuntimeError, match=r"needs 10 tokens \+ reserve 1, each of the 2 requests "
                       r"holds 8 .*max_tokens >= 24; nothing was stored"):  # fmt: skip
        pg.step(0, 1, 2, 10, None, None, cpu, reserve=1)
    assert pg.slot_table.lens.tolist() == [0, 0]
    with pytest.raises(ValueError, match="only left padding"):
        pg.step(0, 1, 2, 3, torch.tensor([[True, False, True]] * 2), None, cpu)
    pg.step(0, 1, 2, 3, None, None, cpu)
    with pytest.raises(ValueError, match="holds 2 requests, the forward has 1: call cache.reset"):
        pg.step(0, 1, 1, 3, None, None, cpu)
    with pytest.raises(ValueError, match="the cache holds requests: reset"):
        pg.start(2, "cpu")
    pg.reset()
    assert not pg.start(2, "cpu") and pg.start(1, "cpu") and pg.slot_table.batch == 1


def test_pager_raises_a_flag_once_then_refuses_until_reset():
    cpu = torch.device("cpu")
    pg = paging.Pager(2 * PS, PS, 1)
    pg.step(0, 1, 1, 6, None, None, cpu)
    pg.step(0, 1, 1, 4, None, None, cpu)  # 10 > 8: flagged on the device, unchecked
    with pytest.raises(RuntimeError, match=r"request\(s\) \[0\] went past their 8 tokens"):
        pg.poll()
    assert not pg.slot_table.full.any()  # cleared: raised once
    with pytest.raises(RuntimeError, match="went past its pages in an earlier forward"):
        pg.poll()
    pg.reset()
    pg.poll()
    pg.step(0, 1, 1, 2, None, torch.tensor([[0, 1]]), cpu)
    pg.step(0, 1, 1, 1, None, torch.tensor([[5]]), cpu)  # not at its length 2
    with pytest.raises(RuntimeError, match=r"did not start at the length of request\(s\) \[0\]"):
        pg.check()
    pg.reset()
    pg.step(0, 1, 1, 6, None, None, cpu)
    pg.step(0, 1, 1, 4, None, None, cpu)
    with pytest.warns(UserWarning, match=r"\[0\] had gone past their 8 tokens"):
        pg.reset()


def test_pager_crop_counts_are_checked():
    pg = paging.Pager(4 * PS, PS, 2)
    pg.crop(0)  # no batch yet: nothing to do
    with pytest.raises(ValueError, match="holds no batch yet"):
        pg.crop(torch.tensor([0, 0]))
    pg.step(0, 1, 2, 5, None, None, "cpu")
    with pytest.raises(ValueError, match=r"\(3,\) counts for 2 requests"):
        pg.crop(torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match=r"\(<= 0\)"):
        pg.crop(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="transformers 5"):
        pg.crop(1)
    pg.crop(torch.tensor([-1, -3]))
    pg.crop(-1)
    assert pg.slot_table.lens.tolist() == [3, 1]


def test_a_requests_pager_checks_its_steps_and_shares_the_refusal():
    cpu = torch.device("cpu")
    pg = paging.Pager(6 * PS, PS, 3)  # 8 tokens a request
    with pytest.raises(ValueError, match="holds no batch yet"):
        pg.request(0)
    pg.start(3, "cpu")
    with pytest.raises(IndexError, match="request 3 of a batch of 3"):
        pg.request(3)
    view = pg.request(1)
    assert view.max_batch == 1 and view.root is pg and view.limit() == 8
    with pytest.raises(ValueError, match=r"request\(1\): a view takes one request on cpu, the "
                       "forward has 2"):  # fmt: skip
        view.step(0, 1, 2, 1, None, None, cpu)
    plan, tokens = view.step(0, 1, 1, 1, None, None, cpu)  # one row, checked all the same
    assert tokens == 1 and plan.slots.tolist() == [2 * PS]
    assert pg.slot_table.lens.tolist() == [0, 1, 0]
    with pytest.raises(RuntimeError, match=r"request needs 9 tokens, each of the 3 requests"):
        view.step(0, 1, 1, 8, None, None, cpu)
    pg.slot_table.full[1] = True
    with pytest.raises(RuntimeError, match=r"request\(s\) \[1\] went past"):
        pg.request(1).check()
    with pytest.raises(RuntimeError, match="an earlier error said so"):
        pg.poll()  # the batch's refusal too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pg.request(1).reset()  # releasing the request lifts it
    pg.poll()
    assert pg.slot_table.lens.tolist() == [0, 0, 0]
