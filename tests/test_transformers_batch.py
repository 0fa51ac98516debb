"""Concurrent requests of different lengths through transformers on the CPU: left-padded
batches (each request equals itself alone), scales that do not depend on the batch, per-
request crop and the batched speculative loop, and the holes a new user found (beam search,
a shared config, a missing cache, the token budget)."""

import contextlib
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers_transformers import (  # noqa: E402
    KS,
    VS,
    E4M3DynamicCache,
    QuantizedDynamicCache,
    counting_backend,
    dense,
    near_tie,
    rowwise,
    tiny,
)
from transformers import AttentionInterface, AutoModelForCausalLM, CompileConfig  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from torch_sm70attn.integrations import speculative  # noqa: E402
from torch_sm70attn.integrations import transformers as hf  # noqa: E402

LENGTHS = (4, 40, 13, 27)  # 10x apart
CAP = 128  # tokens of pages per request, the same alone and in a batch


@pytest.fixture(scope="module")
def model():
    hf.register()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny(), attn_implementation=hf.NAME, dtype=torch.float16
    )


def requests(lengths=LENGTHS, seed=0):
    """Prompts with a repeated stretch (for prompt lookup), as lists of ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        base = torch.randint(0, 256, (max(n // 2, 2),), generator=g)
        out.append(base.repeat(3)[:n])
    return out


def left_padded(prompts, pad=0):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = p, 1
    return ids, mask


def cache(model, batch=1, **kw):
    kw = {"k_scale": KS, "v_scale": VS, "max_tokens": batch * CAP, **kw}
    return hf.PagedE4M3Cache(model.config, max_batch_size=batch, **kw)


def greedy_alone(model, prompt, new):
    """A request generated alone, greedy: its new tokens and the logits of each step (for
    helpers_transformers.near_tie)."""
    with torch.no_grad():
        out = model.generate(
            prompt[None], cache=cache(model), max_new_tokens=new, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, prompt.numel() :], out.logits


def gen(model, ids, c, mask=None, new=12, **kw):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, cache=c, max_new_tokens=new, do_sample=False, **kw
        )
    return out[:, ids.shape[1] :]


def test_left_padded_batch_equals_each_request_alone(model):
    """Bitwise, with the model's GEMMs row by row (`rowwise`: the library's part, whatever the
    CPU's float16 GEMMs do with the batch)."""
    prompts = requests()
    ids, mask = left_padded(prompts)
    with rowwise(model):
        batch = gen(model, ids, cache(model, 4), mask)
        for b, p in enumerate(prompts):
            alone = gen(model, p[None], cache(model))
            assert torch.equal(batch[b], alone[0]), (b, batch[b], alone[0])


def test_a_left_padded_prompt_longer_than_a_row_block_equals_itself_alone(model):
    """A prompt of more rows than the varlen reference's row block (256) behind left padding:
    its prompt forward and tokens are the bits of the request alone (the blocks ended at the
    padding's first row, and its logits differed from alone's by rounding: 0.06 on the shipped
    model's 2000-token prompt padded to 3000)."""
    prompts = requests((400, 300), seed=9)
    ids, mask = left_padded(prompts)
    per = 448  # tokens of pages per request, alone and in the batch
    with rowwise(model):
        batch = gen(model, ids, cache(model, 2, max_tokens=2 * per), mask, new=4)
        for b, p in enumerate(prompts):
            alone = gen(model, p[None], cache(model, 1, max_tokens=per), new=4)
            assert torch.equal(batch[b], alone[0]), (b, batch[b], alone[0])
        with torch.no_grad():
            got = model(ids, attention_mask=mask, position_ids=hf.positions(mask),
                        cache=cache(model, 2, max_tokens=2 * per)).logits  # fmt: skip
            want = model(prompts[1][None], cache=cache(model, 1, max_tokens=per)).logits
    assert torch.equal(got[1, -300:], want[0])


def test_left_padded_batch_compiled_equals_eager(model):
    prompts = requests(seed=1)
    ids, mask = left_padded(prompts)
    want = gen(model, ids, cache(model, 4), mask)
    backend, graphs = counting_backend()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles only on GPUs otherwise
    got = gen(model, ids, cache(model, 4), mask, compile_config=config)
    assert torch.equal(got, want)
    assert len(graphs) == 1, graphs  # the decode step: one graph, no break


def test_padding_is_not_stored_and_pad_rows_are_zero(model):
    prompts = requests((3, 20))
    ids, mask = left_padded(prompts)
    c = cache(model, 2)
    seen = []

    def spy(module, query, key, value, attention_mask, **kw):
        out, _ = hf.attention(module, query, key, value, attention_mask, **kw)
        seen.append(out)
        return out, None

    from transformers import AttentionInterface

    AttentionInterface.register("spy", spy)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register("spy", hf.mask_function)
    model.set_attn_implementation("spy")
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, cache=c).logits
    finally:
        model.set_attn_implementation(hf.NAME)
    assert c.lens.tolist() == [3, 20]  # real tokens only
    assert torch.isfinite(logits).all()
    for out in seen:  # request 0's 17 rows of padding see nothing: zeros, not NaN
        assert torch.isfinite(out).all() and not out[0, :17].any() and out[0, 17:].any()
    # the pad rows' slots were -1: request 0's pages hold its 3 tokens and zeros after
    page0 = c.layers[0].keys[c.table[0, 0]].view(torch.uint8)
    assert page0[:3].any() and not page0[3:].any()


def test_per_request_crop_is_one_device_op(model):
    c = cache(model, 2)
    ids, mask = left_padded(requests((10, 30)))
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=c)
    c.crop(torch.tensor([-2, 0]))
    assert c.lens.tolist() == [8, 30]
    with pytest.raises(ValueError, match="minus the number"):
        c.crop(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="counts for 2 requests"):
        c.crop(torch.tensor([-1]))


def test_speculative_batch_emits_each_requests_greedy_tokens(model):
    prompts = requests(seed=2)
    ids, mask = left_padded(prompts)
    c = hf.PagedE4M3Cache(
        model.config, max_tokens=4 * CAP, max_batch_size=4, k_scale=KS, v_scale=VS
    )
    with rowwise(model):  # bitwise: the library's part (see rowwise)
        out = speculative.generate(model, ids, mask, cache=c, max_new_tokens=20, drafts=4)
        assert out.steps < 20 and max(out.accepted) > 0  # drafts were accepted
        for b, p in enumerate(prompts):
            alone = gen(model, p[None], cache(model), new=20)
            assert torch.equal(out.tokens[b], alone[0]), (b, out.tokens[b], alone[0])


def test_speculative_compiled_verify_steps(model):
    prompts = requests(seed=3)
    ids, mask = left_padded(prompts)
    want = speculative.generate(model, ids, mask, cache=cache(model, 4), max_new_tokens=16)
    backend, graphs = counting_backend()
    fwd = torch.compile(model, backend=backend, fullgraph=True)
    got = speculative.generate(
        model, ids, mask, cache=cache(model, 4), max_new_tokens=16, forward=fwd
    )
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    assert len(graphs) == 1, graphs  # one verify width, one graph


def test_speculative_refuses_a_budget_before_the_prompt(model):
    ids, mask = left_padded(requests((40, 10)))
    c = hf.PagedE4M3Cache(model.config, max_tokens=2 * 64, max_batch_size=2)
    with pytest.raises(RuntimeError, match=r"needs 40 tokens \+ reserve 37.*max_tokens >= 160"):
        speculative.generate(model, ids, mask, cache=c, max_new_tokens=30, drafts=7)
    assert c.lens.tolist() == [0, 0]  # nothing stored


def test_prompt_lookup_drafts():
    t = torch.tensor([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6])
    assert speculative.prompt_lookup(t, 3).tolist() == [7, 9, 5]  # latest "5 6"
    assert speculative.prompt_lookup(torch.tensor([1, 2, 3]), 3).numel() == 0


# --- scales ---------------------------------------------------------------------------------
def test_calibrated_scales_do_not_depend_on_the_batch(model):
    short, wide = requests((12, 30), seed=4)
    c = hf.PagedE4M3Cache(model.config, max_tokens=2 * CAP, max_batch_size=2)
    assert c.scales() == ([None, None], [None, None])  # calibrated at the first forward
    c.calibrate(model, torch.cat([short, wide[:12]])[None])  # a sample
    ks, vs = c.scales()  # the public reading: float32 [H_kv] per layer, copies
    assert [k.shape for k in ks] == [(2,), (2,)] and ks[0].dtype == torch.float32
    assert all(bool((k > 0).all()) for k in ks + vs)
    ids, mask = left_padded([short, wide])
    both = gen(model, ids, c, mask)
    c.reset()  # reset keeps the scales
    assert all(torch.equal(a, b) for a, b in zip(c.scales()[0], ks, strict=True))
    one = hf.PagedE4M3Cache(model.config, max_tokens=CAP)
    one.calibrate(model, torch.cat([short, wide[:12]])[None])
    assert torch.equal(gen(model, short[None], one)[0], both[0])
    given = hf.PagedE4M3Cache(model.config, max_tokens=CAP, k_scale=ks, v_scale=vs)
    assert torch.equal(gen(model, short[None], given)[0], both[0])  # the same stored values


def test_scales_per_layer_and_from_a_checkpoint(model, tmp_path):
    from safetensors.torch import save_file

    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.05),
            "model.layers.0.self_attn.v_scale": torch.tensor(0.04),
            "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([0.06, 0.07]),
            "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(0.03),
            "model.layers.1.mlp.up_proj.weight": torch.zeros(2, 2),
        },
        str(tmp_path / "model.safetensors"),
    )
    ks, vs = hf.kv_scales_from_checkpoint(tmp_path)
    c = hf.PagedE4M3Cache(model.config, max_tokens=CAP, k_scale=ks, v_scale=vs)
    with torch.no_grad():
        model(requests((20,))[0][None], cache=c)
    assert c.layers[0].k_scale.tolist() == pytest.approx([0.05, 0.05])
    assert c.layers[1].k_scale.tolist() == pytest.approx([0.06, 0.07])
    assert c.layers[1].v_scale.tolist() == pytest.approx([0.03, 0.03])
    with pytest.raises(ValueError, match="one scale per layer"):
        hf.PagedE4M3Cache(model.config, k_scale=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="no KV-cache scales"):
        hf.kv_scales_from_checkpoint(tmp_path / "none")


def test_saturation_is_counted_and_warned(model):
    c = hf.PagedE4M3Cache(model.config, max_tokens=CAP, k_scale=1e-4, v_scale=VS)
    with pytest.warns(UserWarning, match=r"of the K and .* saturated at 448 x scale"):
        with torch.no_grad():
            model(requests((20,))[0][None], cache=c)
    assert c.saturated[0] > 0.5 * c.counted and c.counted == 2 * 20 * 2 * 128


# --- the holes ------------------------------------------------------------------------------
def test_beam_search_equals_stocks_cache_over_the_same_codes(model):
    """Beam search reorders the paged cache's slots as transformers' own cache reorders its
    tensors: the same tokens, bitwise, where both hold the same E4M3 codes and the same op
    attends (two attention implementations would part at near ties, which CPUs break either
    way). The prompt is 16 tokens, so every step takes the op's route."""
    ids = requests((16,), seed=5)[0][None]
    ours = gen(model, ids, cache(model, 2), num_beams=2, new=16)
    AttentionInterface.register("dense_e4m3", dense)
    AttentionMaskInterface.register("dense_e4m3", hf.mask_function)
    model.set_attn_implementation("dense_e4m3")
    try:
        stock = gen(model, ids, E4M3DynamicCache(), num_beams=2, new=16)
    finally:
        model.set_attn_implementation(hf.NAME)
    assert torch.equal(ours, stock), (ours, stock)


def test_a_model_not_on_the_sm70attn_attention_is_detected():
    hf.register()
    cfg = tiny(vocab=64, hidden=128, heads=4, head_dim=64)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.NAME, dtype=torch.float16)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float16)
    assert ours.config._attn_implementation == "sdpa"  # the shared config was overwritten
    c = hf.PagedE4M3Cache(ours.config, max_tokens=64)
    with pytest.raises(RuntimeError, match="attn_implementation is 'sdpa'.*copy.deepcopy"):
        with torch.no_grad():
            ours(torch.randint(0, 64, (1, 5)), cache=c)


def test_a_cache_built_from_another_models_config_names_that(model):
    """The cache's config says sm70attn, the model running it another attention: the error said
    "its attn_implementation is 'sm70attn', not 'sm70attn'"; it names the mismatch now."""
    stock = AutoModelForCausalLM.from_config(
        copy.deepcopy(model.config), attn_implementation="sdpa", dtype=torch.float16
    )
    c = hf.PagedE4M3Cache(model.config, max_tokens=64)  # model's config: sm70attn
    with pytest.raises(RuntimeError, match="built from another model's config") as e:
        with torch.no_grad():
            stock(torch.randint(0, 256, (1, 5)), cache=c)
    assert "not 'sm70attn'" not in str(e.value)


def test_a_used_cache_refuses_a_new_prompt_of_any_length_until_reset(model):
    """generate() on a cache that holds another request fed the new prompt's tokens past the
    cache's length: a longer prompt silently continued the old one (its first tokens standing
    for the cached ones), a shorter one died in a reshape of 0 elements, an equal one raised
    after storing. Each now raises before anything is stored, naming cache.reset(); the cache
    keeps what it held, so a continuation (the whole sequence passed again) still works after
    a refusal, and a new prompt after reset() gives a fresh cache's tokens. After an overflow
    the cache stays refused until reset()."""
    a, b, c_ = requests((30, 20), seed=5)[0], *requests((30, 70), seed=6)
    c = cache(model, 1)

    def gen(ids, n=6):
        with torch.no_grad():
            return model.generate(
                ids[None], attention_mask=torch.ones_like(ids[None]), cache=c, max_new_tokens=n,
                do_sample=False, disable_compile=True,
            )  # fmt: skip

    first = gen(a)
    more = gen(first[0], 4)  # the whole sequence: a continuation, as transformers' caches take
    assert torch.equal(more[0, : first.shape[1]], first[0]) and c.get_seq_length() == 39
    assert torch.equal(more, gen_fresh(model, first[0], 4))  # what a fresh cache gives it
    tail = torch.tensor([7, 8, 9])
    new_prompts = {
        "shorter, generate feeds its last token": b[:20],
        "shorter, generate feeds no token": b[:12],
        "as long as what the cache holds": c_[:39],
        "longer, fed from the cache's length": c_,
        "the continuation with a token changed": torch.cat([more[0, :5], tail, more[0, 8:]]),
    }
    for what, ids in new_prompts.items():
        with pytest.raises(ValueError, match=r"holds up to 39 tokens a request.*do not continue"
                           r".*call cache.reset\(\) first.*Nothing was stored"):  # fmt: skip
            gen(ids)
        assert c.get_seq_length() == 39, what
    again = gen(torch.cat([more[0], tail]), 3)  # still continues, nothing was stored
    assert torch.equal(again, gen_fresh(model, torch.cat([more[0], tail]), 3))
    c.reset()
    assert torch.equal(gen(c_), gen_fresh(model, c_))
    c.reset()
    with pytest.raises(RuntimeError, match="is full"):
        gen(a, CAP)
    for ids in (b, a[:3]):  # a prompt within the lengths left at capacity, and a short one
        with pytest.raises(
            RuntimeError, match=r"went past its pages in an earlier forward.*reset\(\)"
        ):
            gen(ids)
    c.reset()
    assert torch.equal(gen(b), gen_fresh(model, b))


def test_generate_on_a_used_cache_reads_the_device_once_more_not_every_step(model, monkeypatch):
    """The check of a new prompt reads the device at generate()'s first step only (the
    cache's length, then the comparison); the decode steps keep a reference to the ids and
    read nothing, as before."""
    ids = requests((30,), seed=7)[0]
    c = cache(model, 1)
    reads = []
    length = c.pager.length
    monkeypatch.setattr(c.pager, "length", lambda: (reads.append(1), length())[1])
    with torch.no_grad():
        out = model.generate(ids[None], cache=c, max_new_tokens=3, do_sample=False)
        counts = []
        for n in (2, 8):  # continuations of 2 and of 8 new tokens
            reads.clear()
            out = model.generate(out, cache=c, max_new_tokens=n, do_sample=False)
            counts.append(len(reads))
    assert counts[0] == counts[1] == 2, counts  # generate's own read, and the check's


def test_a_batch_continuation_names_the_request_that_changed(model):
    prompts = requests((9, 14), seed=8)
    ids, mask = left_padded(prompts)
    c = cache(model, 2)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=c, max_new_tokens=4, do_sample=False)
        grown = torch.cat([out, torch.full((2, 2), 5)], 1)
        more = torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], 1)
        bad = grown.clone()
        bad[1, -8] += 1  # a token request 1's pages hold
        with pytest.raises(ValueError, match=r"request\(s\) \[1\] do not start with the ids"):
            model.generate(bad, attention_mask=more, cache=c, max_new_tokens=2, do_sample=False)
        model.generate(grown, attention_mask=more, cache=c, max_new_tokens=2, do_sample=False)
    # each: its prompt, 3 of its 4 tokens, then the 4th and the 2 added, then 1 of 2 more
    assert c.lens.tolist() == [9 + 3 + 3 + 1, 14 + 3 + 3 + 1]


def gen_fresh(model, ids, n=6):
    with torch.no_grad():
        return model.generate(
            ids[None], attention_mask=torch.ones_like(ids[None]), cache=cache(model, 1),
            max_new_tokens=n, do_sample=False, disable_compile=True,
        )  # fmt: skip


def test_generate_without_the_cache_warns_once(model):
    hf.warned.discard("unpaged")
    ids = requests((10,))[0][None]
    with pytest.warns(UserWarning, match="without a PagedE4M3Cache"):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)


def test_reserve_is_checked_before_the_prompt(model):
    c = hf.PagedE4M3Cache(model.config, max_tokens=2 * 48, max_batch_size=2, reserve=20)
    ids, mask = left_padded(requests((30, 5)))
    with pytest.raises(RuntimeError, match=r"needs 30 tokens \+ reserve 20.*max_tokens >= 128"):
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=c)
    assert c.lens.tolist() == [0, 0]


def test_a_compiled_step_past_the_budget_raises_at_the_next_host_read(model):
    c = hf.PagedE4M3Cache(model.config, max_tokens=32, k_scale=KS, v_scale=VS)
    backend, _ = counting_backend()
    fwd = torch.compile(model, backend=backend, fullgraph=True)
    ids = requests((30,))[0][None]
    with torch.no_grad():
        model(ids, cache=c)
        fwd(ids[:, :1], cache=c, position_ids=torch.tensor([[30]]))  # 31 tokens
        fwd(ids[:, :1], cache=c, position_ids=torch.tensor([[31]]))  # 32
        fwd(ids[:, :1], cache=c, position_ids=torch.tensor([[32]]))  # 33: past, not stored
    with pytest.raises(RuntimeError, match=r"\[0\] went past their 32 tokens.*not stored"):
        c.get_seq_length()
    assert c.get_seq_length() == 32  # stopped at the capacity


def test_a_prompt_holding_the_pad_token_gets_the_fix(model):
    """generate() derives a mask from pad_token_id when given none: a prompt holding that token
    mid-sequence has a hole, refused with what to pass instead."""
    ids = requests((20,))[0][None].clone()
    saved = model.generation_config.pad_token_id
    model.generation_config.pad_token_id = int(ids[0, 7])
    try:
        with pytest.raises(ValueError, match=r"attention_mask=torch.ones_like\(ids\)"):
            gen(model, ids, cache(model))
        got = gen(model, ids, cache(model), torch.ones_like(ids))  # the fix works
    finally:
        model.generation_config.pad_token_id = saved
    assert torch.equal(got, gen(model, ids, cache(model)))


@pytest.mark.parametrize("kernels", ["rowwise", "as_is"])
@pytest.mark.parametrize("same", [True, False])
def test_speculative_batch_with_an_assistant_model(model, same, kernels):
    """Drafts from an assistant model instead of prompt lookup: the model itself (every draft
    accepted) or another random one (few). With the models' GEMMs row by row (`rowwise`), each
    request's tokens are its greedy tokens alone, bitwise; as they are, up to a near tie (on
    CPUs whose float16 GEMMs round with the number of rows, a draft and its verify part there)."""
    if same:
        assistant = model
    else:
        torch.manual_seed(1)
        cfg = tiny(hidden=128, heads=4, head_dim=64)
        assistant = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=hf.NAME, dtype=torch.float16
        )
    prompts = requests(seed=9)
    ids, mask = left_padded(prompts)
    with rowwise(model, assistant) if kernels == "rowwise" else contextlib.nullcontext():
        out = speculative.generate(
            model, ids, mask, cache=cache(model, 4), max_new_tokens=16, drafts=3,
            assistant=assistant, assistant_cache=cache(assistant, 4),
        )  # fmt: skip
        alone = [greedy_alone(model, p, 16) for p in prompts]
    for b, (tokens, logits) in enumerate(alone):
        tie = near_tie(out.tokens[b], tokens, logits)
        assert kernels == "as_is" or tie == "tokens equal", (b, tie)
    if same and kernels == "rowwise":
        assert out.accepted[:-1] == [3.0] * (len(out.accepted) - 1), out.accepted


def test_speculative_budget_holds_when_requests_finish_apart(model):
    """A request that finishes early keeps stepping (cropped to nothing) while the others
    run: prompt + max_new_tokens + drafts per request is enough (the review's case: a request
    that keeps more accepted drafts than it still needs would grow past it)."""
    ids, mask = left_padded(requests((41, 9), seed=11))
    c = hf.PagedE4M3Cache(model.config, max_tokens=2 * 64, max_batch_size=2, k_scale=KS, v_scale=VS)
    out = speculative.generate(model, ids, mask, cache=c, max_new_tokens=16, drafts=7)
    assert [len(t) for t in out.tokens] == [16, 16]
    assert int(c.lens.max()) <= 41 + 16 - 1 and not c.full.any()


def test_short_prompts_are_checked_too(model):
    """A first forward of 16 rows or fewer takes the decode route; the padding and reserve
    checks still run before anything is stored."""
    c = cache(model, 2, reserve=200)
    ids, mask = left_padded(requests((6, 3)))
    with pytest.raises(RuntimeError, match=r"reserve 200"):
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=c)
    mask[1, 4] = 0  # a hole
    with pytest.raises(ValueError, match="only left padding"):
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=cache(model, 2))


def test_reset_warns_about_an_unreported_overflow(model):
    c = hf.PagedE4M3Cache(model.config, max_tokens=32, k_scale=KS, v_scale=VS)
    ids = requests((30,))[0][None]
    with torch.no_grad():
        model(ids, cache=c)
        model(ids[:, :4], cache=c, position_ids=torch.arange(30, 34)[None])  # 34 > 32
    with pytest.warns(UserWarning, match=r"\[0\] had gone past their 32 tokens"):
        c.reset()
    assert c.get_seq_length() == 0


def test_checkpoint_scales_of_several_stacks_need_a_prefix(tmp_path):
    from safetensors.torch import save_file

    def t(x):
        return torch.tensor(x)

    save_file(
        {
            "model.layers.0.self_attn.k_scale": t(0.05),
            "model.layers.0.self_attn.v_scale": t(0.05),
            "model.vision_tower.layers.0.self_attn.k_scale": t(0.1),
            "model.vision_tower.layers.0.self_attn.v_scale": t(0.1),
        },
        str(tmp_path / "m.safetensors"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="several prefixes"):
        hf.kv_scales_from_checkpoint(tmp_path)
    ks, vs = hf.kv_scales_from_checkpoint(tmp_path, prefix="model.")
    assert [k.item() for k in ks] == pytest.approx([0.05])


def test_left_padded_batch_equals_stock_over_the_same_values_up_to_a_tie(model):
    """The same padded batch through transformers' stock sdpa attention over a DynamicCache
    holding what the paged cache holds (e4m3(x / scale) * scale): the same greedy tokens up to
    the first step where stock's logits of the two tokens are within 1% of their range. (On
    torch 2.10's CPU build request 1 parts at step 7, where stock's two logits are equal in
    fp16: 0.8442 both; on 2.13 the tokens are equal throughout.)"""
    ids, mask = left_padded(requests((5, 60, 23, 41), seed=12))
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
    kw.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ours = model.generate(ids, cache=cache(model, 4), **kw)
        model.set_attn_implementation("sdpa")
        try:
            stock = model.generate(ids, cache=QuantizedDynamicCache(), **kw)
        finally:
            model.set_attn_implementation(hf.NAME)
    n = ids.shape[1]
    for b in range(ids.shape[0]):
        stock_b = [step[b : b + 1] for step in stock.logits]  # this request's logits a step
        near_tie(ours.sequences[b, n:], stock.sequences[b, n:], stock_b)


# --- continuous batching: requests join a running batch ------------------------------------------
def test_serve_emits_each_requests_greedy_tokens(model):
    """Six requests of 4-40 tokens through 2 slots: each joins as a slot frees and emits the
    tokens greedy decoding emits for it alone."""
    prompts = requests((4, 40, 13, 27, 9, 33), seed=4)
    c = cache(model, 2)
    out = speculative.serve(model, prompts, cache=c, max_new_tokens=16, drafts=4)
    assert out.steps < 6 * 16 // 2 and max(out.accepted) > 0  # drafts were accepted
    assert len(out.emitted) == len(out.times)
    for b, p in enumerate(prompts):
        alone = gen(model, p[None], cache(model), new=16)
        assert torch.equal(out.tokens[b], alone[0]), (b, out.tokens[b], alone[0])
        assert sum(r[b] for r in out.emitted) == 16
    # a request starts only when one before it ends: never more than 2 emit in a round
    assert max(sum(k > 0 for k in r) for r in out.emitted) <= 2


def test_serve_compiled_verify_steps_one_graph(model):
    """Compiled verify steps give the eager loop's tokens in one graph while requests come and
    go, and a second call on the same cache keeps the table (a CUDA graph replays it)."""
    prompts = requests((4, 40, 13, 27, 9), seed=5)
    want = speculative.serve(model, prompts, cache=cache(model, 2), max_new_tokens=12, drafts=3)
    backend, graphs = counting_backend()
    fwd = torch.compile(model, backend=backend, fullgraph=True)
    c = cache(model, 2)
    got = speculative.serve(model, prompts, cache=c, max_new_tokens=12, drafts=3, forward=fwd)
    table, lens = c.table, c.lens
    again = speculative.serve(model, prompts, cache=c, max_new_tokens=12, drafts=3, forward=fwd)
    assert c.table is table and c.lens is lens
    for out in (got, again):
        assert [t.tolist() for t in out.tokens] == [t.tolist() for t in want.tokens]
    assert len(graphs) == 1, graphs  # requests came and went: one verify graph


def test_serve_records_one_cuda_graph_over_two_calls(model, monkeypatch):
    """The backend's CUDA-graph recorder (emulated on the CPU, as tests/test_cudagraphs.py
    does) records the verify step once: a second call on the same cache keeps its table,
    lengths and flags where the graph reads them (it was recorded again per call before)."""
    from helpers_cudagraphs import emulated
    from torch._dynamo.utils import counters

    emulated(monkeypatch)
    prompts = requests((4, 40, 13, 27, 9), seed=5)
    torch._dynamo.reset()
    fwd = torch.compile(
        model, backend=hf.NAME, fullgraph=True, dynamic=False, options={"inner": "cudagraphs"}
    )
    c, outs = cache(model, 2), []
    counters.clear()
    for _ in range(2):
        outs.append(speculative.serve(model, prompts, cache=c, max_new_tokens=12, drafts=3,
                                      forward=fwd))  # fmt: skip
        assert counters["sm70attn"]["cuda_graph_recordings"] == 1, dict(counters["sm70attn"])
    assert [t.tolist() for t in outs[0].tokens] == [t.tolist() for t in outs[1].tokens]


def test_serve_finishing_at_the_prompt_and_at_eos(model):
    prompts = requests((5, 12, 30), seed=6)
    out = speculative.serve(model, prompts, cache=cache(model, 2), max_new_tokens=1)
    assert out.steps == 0 and [t.numel() for t in out.tokens] == [1, 1, 1]
    full = speculative.serve(model, prompts, cache=cache(model, 2), max_new_tokens=10, drafts=2)
    eos = int(full.tokens[1][3])  # request 1 stops at its 4th token (or earlier, if it repeats)
    cut = speculative.serve(
        model, prompts, cache=cache(model, 2), max_new_tokens=10, drafts=2, eos_token_id=eos
    )
    for a, b in zip(full.tokens, cut.tokens, strict=True):
        n = (a == eos).nonzero().flatten()
        want = a if not n.numel() else a[: int(n[0]) + 1]
        assert torch.equal(b, want), (a, b)


def test_generate_and_serve_stop_at_the_models_eos_as_model_generate_does(model):
    """eos_token_id=None takes the model's generation_config.eos_token_id (model.generate's
    default); [] turns it off."""
    prompts = requests((12, 30), seed=6)
    ids, mask = left_padded(prompts)
    kw = dict(max_new_tokens=10, drafts=2)
    free = speculative.generate(model, ids, mask, cache=cache(model, 2), **kw)
    eos = int(free.tokens[1][3])  # request 1 stops at its 4th token (or earlier, if it repeats)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        got = speculative.generate(model, ids, mask, cache=cache(model, 2), **kw)
        served = speculative.serve(model, prompts, cache=cache(model, 2), **kw)
        off = speculative.generate(model, ids, mask, cache=cache(model, 2), eos_token_id=[], **kw)
        stock = [greedy_alone(model, p, 10)[0] for p in prompts]
    finally:
        model.generation_config.eos_token_id = saved
    for b, a in enumerate(free.tokens):
        n = (a == eos).nonzero().flatten()
        want = a if not n.numel() else a[: int(n[0]) + 1]
        assert torch.equal(got.tokens[b], want) and torch.equal(served.tokens[b], want), b
        assert torch.equal(off.tokens[b], a), b
        # stock generate stops there too (it pads a finished row with the pad id)
        assert torch.equal(stock[b][: want.numel()], want), (b, stock[b], want)
    assert got.tokens[1].numel() < 10


def test_generate_refuses_what_is_not_a_batch_before_any_forward(model):
    """What a new user passed (each failed inside the model or the cache before): Python lists,
    1-D ids, an empty prompt, float ids, ids of another vocabulary, a mask of another shape or
    with an empty row, no cache, a DynamicCache."""
    from transformers import DynamicCache

    ids = requests((12,), seed=3)[0][None]
    c = cache(model, 2)
    bad = [
        (TypeError, r"input_ids is a list; pass a \[B, T\] integer tensor", ids[0].tolist(), None, c),
        (ValueError, r"input_ids is 1-D \[12\]; .*ids\[None\] for one request", ids[0], None, c),
        (ValueError, r"input_ids \[1, 0\] holds no tokens", ids[:, :0], None, c),
        (TypeError, r"input_ids is a torch.float32 tensor", ids.float(), None, c),
        (ValueError, r"outside \[0, 256\), the model's vocab_size", ids + 256, None, c),
        (ValueError, r"attention_mask is \[1, 11\], input_ids \[1, 12\]", ids, ids[:, 1:], c),
        (ValueError, r"attention_mask row 1 holds no tokens",
         ids.repeat(2, 1), torch.tensor([[1] * 12, [0] * 12]), c),
        (TypeError, r"cache is None; pass an empty .*PagedE4M3Cache\(model.config", ids, None, None),
        (TypeError, r"cache is DynamicCache; pass an empty", ids, None, DynamicCache()),
    ]  # fmt: skip
    for err, match, x, mask, cc in bad:
        with pytest.raises(err, match=match):
            speculative.generate(model, x, mask, cache=cc, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"speculative.serve: cache is DynamicCache"):
        speculative.serve(model, [ids[0]], cache=DynamicCache(), max_new_tokens=4)
    assert c.lens is None  # nothing ran


def test_a_prompt_through_request_b_touches_request_b_only(model):
    """cache.request(b): a batch of one over request b's pages; the others' pages, lengths and
    the logits match a fresh cache of one, bit for bit."""
    a, b_, c_ = requests((20, 11, 35), seed=7)
    c = cache(model, 3)
    c.start(3, "cpu")
    with torch.no_grad():
        for slot, p in ((0, a), (2, c_)):
            model(p[None], cache=c.request(slot), position_ids=torch.arange(p.numel())[None])
        keys = [layer.keys.clone() for layer in c.layers]
        lens = c.lens.clone()
        got = model(b_[None], cache=c.request(1), position_ids=torch.arange(b_.numel())[None])
        want = model(b_[None], cache=cache(model), position_ids=torch.arange(b_.numel())[None])
    assert torch.equal(got.logits, want.logits)
    assert c.lens.tolist() == [lens[0], b_.numel(), lens[2]]
    W = c.table.shape[1] * c.page_size  # request 1 owns pages W .. 2W - 1 (as tokens)
    for layer, before in zip(c.layers, keys, strict=True):
        flat, old = layer.keys.flatten(0, 1), before.flatten(0, 1)
        assert torch.equal(flat[:W].view(torch.uint8), old[:W].view(torch.uint8))
        assert torch.equal(flat[2 * W :].view(torch.uint8), old[2 * W :].view(torch.uint8))
        assert not torch.equal(flat[W : 2 * W].view(torch.uint8), old[W : 2 * W].view(torch.uint8))
    c.release(1)
    assert c.lens.tolist() == [lens[0], 0, lens[2]]


def test_request_views_refuse_what_they_cannot_serve(model):
    c = cache(model, 2)
    with pytest.raises(ValueError, match="holds no batch yet"):
        c.request(0)
    c.start(2, "cpu")
    with pytest.raises(IndexError, match="request 2 of a batch of 2"):
        c.request(2)
    with pytest.raises(ValueError, match=r"request\(1\): a view takes one request"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=c.request(1))
    long = requests((120,), seed=8)[0]
    with pytest.raises(RuntimeError, match=r"request 1 needs 120 tokens \+ reserve 18.*>= 288"):
        speculative.serve(model, [long[:20], long], cache=c, max_new_tokens=10, drafts=8)
    assert c.lens.tolist() == [0, 0]  # refused before any forward: request 0 did not run
    with pytest.raises(ValueError, match=r"prompt 1 holds no tokens"):
        speculative.serve(model, [long, long[:0]], cache=c, max_new_tokens=10)
    with pytest.raises(TypeError, match="a list of 1-D integer tensors.*not a 1-D tensor"):
        speculative.serve(model, long, cache=c, max_new_tokens=10)
    one = speculative.serve(model, [long[:20]], cache=c, max_new_tokens=4)  # a free slot too
    assert c.table.shape == (2, 128 // c.page_size) and one.tokens[0].numel() == 4


def test_serve_and_generate_refuse_what_is_not_a_request_before_any_forward(model):
    """What a new user passed: Python lists (AttributeError on .numel), a padded 2-D batch
    (its padding silently taken for prompt tokens), ids of another vocabulary and an assistant
    of another vocabulary (IndexError in an embedding). Each is refused before any forward,
    with what is expected."""
    c = cache(model, 2)
    ids = requests((12, 7), seed=3)
    bad = [
        (TypeError, r"prompt 0 is a list; prompts are a list of 1-D integer tensors", [[1, 2, 3]]),
        (
            TypeError,
            r"not a 2-D tensor: .*list\(ids.unbind\(0\)\)",
            torch.stack([ids[0][:7], ids[1]]),
        ),
        (TypeError, r"prompt 1 is a 1-D torch.float32 tensor", [ids[0], ids[1].float()]),
        (TypeError, r"prompt 0 is a 2-D torch.int64 tensor", [ids[0][None]]),
        (ValueError, r"prompt 1 holds token ids outside \[0, 256\)", [ids[0], ids[1] + 256]),
        (TypeError, r"not dict", {0: ids[0]}),
    ]
    for err, match, prompts in bad:
        with pytest.raises(err, match=match):
            speculative.serve(model, prompts, cache=c, max_new_tokens=4)
    assert c.lens is None  # nothing ran
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(
        tiny(vocab=300, hidden=128, heads=4, head_dim=64), attn_implementation=hf.NAME,
        dtype=torch.float16,
    )  # fmt: skip
    for fn, args in ((speculative.serve, [ids[0]]), (speculative.generate, ids[0][None])):
        with pytest.raises(ValueError, match="assistant's vocab_size is 300, the model's 256"):
            fn(model, args, cache=c, max_new_tokens=4, assistant=other,
               assistant_cache=cache(other, 2))  # fmt: skip
    assert c.lens is None


@pytest.mark.parametrize("chunk", [None, 8])
def test_serve_counts_saturation_in_the_cache_and_warns_once(model, chunk):
    prompts = requests((30, 40, 25), seed=9)
    c = cache(model, 2, k_scale=1e-4, v_scale=1e-4)  # far too small: values saturate
    with pytest.warns(UserWarning, match="saturated") as seen:
        speculative.serve(model, prompts, cache=c, max_new_tokens=3, drafts=2, prefill_chunk=chunk)
    assert sum("saturated" in str(w.message) for w in seen) == 1
    # every prompt token counted through its view, chunks of 8 rows too: layers x H_kv x D x
    # tokens
    assert min(c.saturated) > 0 and c.counted == 2 * 2 * 128 * (30 + 40 + 25)


def test_serve_in_chunks_calibrates_on_the_first_prompt_whole(model):
    """Default scales come from the first tokens stored: with prefill_chunk they come from the
    first prompt whole, not its first chunk (the same scales as without chunks)."""
    prompts = requests((30, 12), seed=12)
    whole, chunked = cache(model, 2, k_scale=None, v_scale=None), None
    speculative.serve(model, prompts, cache=whole, max_new_tokens=3)
    chunked = cache(model, 2, k_scale=None, v_scale=None)
    speculative.serve(model, prompts, cache=chunked, max_new_tokens=3, prefill_chunk=1)
    for a, b in zip(whole.layers, chunked.layers, strict=True):
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)


def test_serve_prefills_a_long_prompt_in_chunks_between_the_others_steps(model):
    """prefill_chunk=16: the 60-token request joins over 4 rounds while the first one keeps
    emitting, and each request still emits its greedy tokens alone (up to a near tie: a
    chunk's attention adds in another order than the whole prompt's)."""
    prompts = requests((6, 60, 9), seed=10)
    got = speculative.serve(
        model, prompts, cache=cache(model, 2), max_new_tokens=30, drafts=3, prefill_chunk=16
    )
    assert [k for k, r in enumerate(got.emitted) if r[1]][0] == 3  # chunks in rounds 0-3
    assert all(got.emitted[k][0] > 0 for k in range(4))  # request 0 did not wait
    for b, p in enumerate(prompts):
        near_tie(got.tokens[b], *greedy_alone(model, p, 30))
    with pytest.raises(ValueError, match="prefill_chunk >= 1"):
        speculative.serve(model, prompts, cache=cache(model, 2), max_new_tokens=3, prefill_chunk=0)


@pytest.mark.parametrize("kernels", ["rowwise", "as_is"])
@pytest.mark.parametrize("same", [True, False])
def test_serve_with_an_assistant_model(model, same, kernels):
    """serve's drafts from an assistant model with its own slots: the model itself (every draft
    accepted), or another random one joining in chunks too; each request emits its greedy
    tokens alone (bitwise for whole prompts with the GEMMs row by row; up to a near tie where
    prompts join in chunks or the models' GEMMs are as they are)."""
    if same:
        assistant, chunk = model, None
    else:
        torch.manual_seed(1)
        cfg = tiny(hidden=128, heads=4, head_dim=64)
        assistant = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=hf.NAME, dtype=torch.float16
        )
        chunk = 16
    prompts = requests((4, 40, 13, 27, 9), seed=11)
    exact = same and kernels == "rowwise"
    with rowwise(model, assistant) if kernels == "rowwise" else contextlib.nullcontext():
        out = speculative.serve(
            model, prompts, cache=cache(model, 2), max_new_tokens=16, drafts=3,
            prefill_chunk=chunk, assistant=assistant, assistant_cache=cache(assistant, 2),
        )  # fmt: skip
        alone = [greedy_alone(model, p, 16) for p in prompts]
    if exact:
        assert out.accepted == [3.0] * out.steps, out.accepted  # every draft accepted
    for b, (tokens, logits) in enumerate(alone):
        tie = near_tie(out.tokens[b], tokens, logits)
        assert not exact or tie == "tokens equal", (b, tie)  # whole prompts: exactly greedy
    with pytest.raises(ValueError, match="assistant_cache of 2 slots"):
        speculative.serve(
            model, prompts, cache=cache(model, 2), max_new_tokens=4, assistant=assistant,
            assistant_cache=cache(assistant, 3),
        )  # fmt: skip
