"""The paging core without a model: the slot table (allocation, a step's lengths and slots
with padding and overflow, crop, beam reorder, one request's view, a compiled step) and the
scales (checked, shaped, calibrated, saturation counted)."""

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
