"""The transformers integration on a real (tiny, randomly initialised) Qwen3 from
transformers' own classes: greedy generation through the paged E4M3 cache equals the stock
SDPA path over the same quantized values, prompt-lookup speculative decoding (verify steps of
up to 5 rows, rollback by crop) emits exactly the greedy tokens, and the routes, scales and
errors hold."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers_transformers import (  # noqa: E402
    FP8,
    KS,
    VS,
    QuantizedDynamicCache,
    counting_backend,
    near_tie,
    rowwise,
    tiny,
)
from oracle import attention_fp64, rel_err  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402

import torch_sm70attn as sa  # noqa: E402
from torch_sm70attn import paging  # noqa: E402
from torch_sm70attn.integrations import transformers as hf  # noqa: E402


@pytest.fixture(scope="module")
def model():
    hf.register()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny(), attn_implementation=hf.NAME, dtype=torch.float16
    )


def prompt(n=20, repeat=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, n), generator=g)
    return torch.cat([ids, ids[:, :repeat]], 1)  # a repetition for prompt lookup to find


def paged(model, **kw):
    return hf.PagedE4M3Cache(model.config, max_tokens=256, k_scale=KS, v_scale=VS, **kw)


def generate(model, ids, cache, **kw):
    with torch.no_grad():
        return model.generate(ids, cache=cache, max_new_tokens=24, do_sample=False, **kw)


def test_greedy_equals_stock_sdpa_over_the_same_quantized_values(model):
    """Our greedy tokens are stock sdpa's over the same E4M3 values up to a near tie of stock's
    logits (the prompt's attention is paged_attention_varlen's FP32 reference, stock's is
    SDPA's: other roundings; on torch 2.10 on an AVX-512 CPU this tiny random model parts at step
    3 of 24, where stock's logit is 0.09% of the logits' range above ours), and one forward's
    logits agree."""
    ids = prompt()
    ours = generate(model, ids, paged(model))
    model.set_attn_implementation("sdpa")
    try:
        stock = generate(model, ids, QuantizedDynamicCache(), output_logits=True,
                         return_dict_in_generate=True)  # fmt: skip
        # and the logits of one prefill + decode step, side by side
        with torch.no_grad():
            want = model(ids, cache=QuantizedDynamicCache()).logits
    finally:
        model.set_attn_implementation(hf.NAME)
    n = ids.shape[1]
    assert torch.equal(ours[0, :n], stock.sequences[0, :n])
    print(near_tie(ours[0, n:], stock.sequences[0, n:], stock.logits))
    with torch.no_grad():
        got = model(ids, cache=paged(model)).logits
    assert rel_err(got, want.double()) < 5e-3


def test_prompt_lookup_verify_steps_emit_the_greedy_tokens(model, monkeypatch):
    rows, crops = [], []
    paged_attention = sa.paged_attention

    def counting(query, *args, **kw):
        rows.append(query.shape[2])
        return paged_attention(query, *args, **kw)

    monkeypatch.setattr(sa, "paged_attention", counting)
    monkeypatch.setattr(hf.sa, "paged_attention", counting)
    ids = prompt(seed=1)
    greedy = generate(model, ids, paged(model))
    rows.clear()
    cache = paged(model)
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    spec = generate(model, ids, cache, prompt_lookup_num_tokens=4)
    assert torch.equal(spec, greedy)
    assert max(rows) > 1, rows  # verify steps of several rows went through the fused op
    assert any(n < 0 for n in crops), crops  # and rejected drafts were rolled back
    assert cache.get_seq_length() == spec.shape[1] - 1  # the last token is not stored yet


def test_prefill_route_is_the_varlen_op_of_the_packed_rows():
    """More than 16 rows (a prompt, a chunk over a past) are packed for paged_attention_varlen:
    on the CPU the same bits as paged_attention's reference, which applies the same rule to any
    number of rows (left padding: rows that see nothing are 0)."""
    g = torch.Generator().manual_seed(3)
    B, H, G, D, ps, P, W, Q = 3, 2, 4, 128, 16, 12, 4, 21
    q = torch.randn(B, H * G, Q, D, generator=g).half()
    kc = (torch.randn(P, ps, H, D, generator=g) * 8).to(FP8)
    vc = (torch.randn(P, ps, H, D, generator=g) * 8).to(FP8)
    bt = torch.randperm(P, generator=g)[: B * W].view(B, W).int()
    sl = torch.tensor([Q, 50, 9], dtype=torch.int32)  # a prompt, a chunk, 12 rows of padding
    ks, vs = torch.tensor([0.05, 0.07]), torch.tensor([0.04, 0.03])
    got = paging.prefill(q, kc, vc, bt, sl, D**-0.5, ks, vs)
    want = sa.paged_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=vs)
    assert torch.equal(got, want) and got[2, :, :12].eq(0).all()
    assert rel_err(got, attention_fp64(q, kc, vc, bt, sl, D**-0.5, ks, vs)) < 2e-3


def test_scales_calibrated_per_kv_head_at_the_first_write(model):
    cache = hf.PagedE4M3Cache(model.config, max_tokens=256)
    with torch.no_grad():
        model(prompt(), cache=cache)
    for layer in cache.layers:
        assert layer.k_scale.shape == (2,) and layer.k_scale.dtype == torch.float32
        assert (layer.k_scale > 0).all() and not torch.equal(layer.k_scale, layer.v_scale)
        # amax / 448 with 2x headroom: the largest stored code is about 224
        assert 150 < layer.keys.float().abs().max() <= 240


def test_crop_and_reset(model):
    cache = paged(model, max_batch_size=2)
    with torch.no_grad():
        model(prompt(), cache=cache)
    assert cache.get_seq_length() == 30 and cache.get_mask_sizes(4, 0) == (4, 0)
    cache.crop(-5)
    assert cache.get_seq_length() == 25 and cache.lens.tolist() == [25]
    with pytest.raises(ValueError, match="minus the number"):
        cache.crop(3)
    with pytest.raises(ValueError, match="call cache.reset"):
        with torch.no_grad():
            model(torch.cat([prompt(), prompt()]), cache=cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.lens.tolist() == [0]
    # after a reset the same cache serves a new prompt as a new cache would
    with torch.no_grad():
        got = model(prompt(seed=2), cache=cache).logits
        want = model(prompt(seed=2), cache=paged(model)).logits
    assert torch.equal(got, want)


def test_equal_length_batch_matches_each_request_alone(model):
    ids = torch.cat([prompt(seed=4), prompt(seed=5)])
    with rowwise(model):  # bitwise: the library's part (see rowwise)
        both = generate(model, ids, paged(model, max_batch_size=2))
        for b in range(2):
            alone = generate(model, ids[b : b + 1], paged(model))
            assert torch.equal(both[b : b + 1], alone)


def test_errors_say_what_to_do(model):
    ids = torch.cat([prompt(seed=6), prompt(seed=7)])
    mask = torch.ones_like(ids)
    mask[1, 5] = 0  # a hole, not left padding
    with pytest.raises(ValueError, match="only left padding"):
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, cache=paged(model, max_batch_size=2), max_new_tokens=2
            )
    with pytest.raises(RuntimeError, match="use max_tokens >= 32; nothing was stored"):
        with torch.no_grad():
            model(prompt(), cache=hf.PagedE4M3Cache(model.config, max_tokens=16))
    with pytest.raises(ValueError, match="max_batch_size"):
        with torch.no_grad():
            model(ids, cache=paged(model))
    assert hf.register() == hf.register() == "sm70attn"
    fewer = tiny()
    fewer.num_hidden_layers = 1  # a config of fewer layers than the model's 2
    with pytest.raises(ValueError, match=r"layer 1 has no pages here: this cache holds 1 layers"):
        with torch.no_grad():
            model(prompt(), cache=hf.PagedE4M3Cache(fewer, max_tokens=256, k_scale=KS, v_scale=VS))


def test_the_cache_is_made_from_the_models_config_and_both_scales_or_neither(model):
    """PagedE4M3Cache(model) was a bare AttributeError ("'Qwen3ForCausalLM' object has no
    attribute 'num_hidden_layers'"), and a k_scale without a v_scale was taken (the other
    calibrated from the first forward): both name the fix now."""
    for wrong, words in ((model, r"got the model \(Qwen3ForCausalLM\): pass model.config"),
                         ({"num_hidden_layers": 2}, r"got a dict: pass model.config")):  # fmt: skip
        with pytest.raises(TypeError, match=words):
            hf.PagedE4M3Cache(wrong, max_tokens=256)
    for kw, words in ((dict(k_scale=KS), "k_scale given without v_scale: give both"),
                      (dict(v_scale=[VS, VS]), "v_scale given without k_scale: give both")):  # fmt: skip
        with pytest.raises(ValueError, match=words + r".*or neither to calibrate"):
            hf.PagedE4M3Cache(model.config, max_tokens=256, **kw)


def test_a_config_of_other_heads_sizes_the_pools_as_the_models_own(model):
    """The cache reads only num_hidden_layers from its config; its pools take the KV heads and
    head dim of the first tokens stored (so that a tensor-parallel rank's pools hold its own
    heads). A config of 1 KV head and head dim 64 for this model (2 and 128) is harmless: the
    same pools, the same tokens."""
    other = tiny(head_dim=64)
    other.num_key_value_heads = 1
    ids = prompt(seed=9)
    mine, theirs = paged(model), hf.PagedE4M3Cache(other, max_tokens=256, k_scale=KS, v_scale=VS)
    want, got = generate(model, ids, mine), generate(model, ids, theirs)
    assert torch.equal(got, want)
    assert theirs.layers[0].keys.shape == mine.layers[0].keys.shape == (16, 16, 2, 128)


def test_calibrate_refuses_what_is_not_a_batch_of_ids_before_any_forward(model):
    """cache.calibrate(model, ids) checked nothing: 1-D ids failed inside the model ("The size
    of tensor a (12) must match the size of tensor b (256)"), float ids in torch's embedding.
    It says what to pass as speculative.generate does."""
    ids = prompt(seed=10)
    cache = hf.PagedE4M3Cache(model.config, max_tokens=256)
    bad = [
        (ValueError, r"calibrate: input_ids is 1-D \[30\]; .*ids\[None\] for one request", ids[0], None),
        (TypeError, r"calibrate: input_ids is a torch.float32 tensor; pass a \[B, T\] integer",
         ids.float(), None),
        (TypeError, r"calibrate: input_ids is a list", ids[0].tolist(), None),
        (ValueError, r"calibrate: input_ids holds token ids outside \[0, 256\), the model's "
         "vocab_size", ids + 256, None),
        (ValueError, r"calibrate: attention_mask is \[1, 29\], input_ids \[1, 30\]: pass one of "
         "its shape", ids, ids[:, 1:]),
    ]  # fmt: skip
    for err, words, x, mask in bad:
        with pytest.raises(err, match=r"PagedE4M3Cache\." + words):
            cache.calibrate(model, x, mask)
    assert cache.lens is None and cache.scales() == ([None, None], [None, None])  # nothing ran
    cache.calibrate(model, ids)
    assert all(s is not None for s in cache.scales()[0])


def test_an_older_transformers_is_refused_at_import_with_the_fix():
    """transformers before 5.24 drops generate's cache argument ("model_kwargs are not used by
    the model: ['cache']", seen on a GPU machine with 5.17): the adapter's import says so."""
    assert hf.version_refusal("5.17.0") == (
        "torch_sm70attn's transformers adapter needs transformers >= 5.24, this is 5.17.0: "
        "pip install 'transformers>=5.24'"
    )
    assert hf.version_refusal("4.57.1") is not None
    for ok in ("5.24.0", "5.24.0.dev0", "5.25.0", "6.0.0"):
        assert hf.version_refusal(ok) is None, ok


def test_float32_model_is_refused_with_the_fix():
    hf.register()
    cfg = tiny(vocab=64, hidden=128, heads=4, head_dim=64)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.NAME, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype=torch.float16"):
        with torch.no_grad():
            m(torch.randint(0, 64, (1, 4)), cache=hf.PagedE4M3Cache(m.config, max_tokens=64))


def test_cli_mistakes_are_one_message_and_a_nonzero_exit():
    """What a new user typed: a model folder that is not there, a context longer than the
    shipped text. One message on stderr, exit 1, no traceback (--debug keeps it)."""
    from helpers_cli import cli

    cases = [
        (("demo", "--device", "cpu", "--model", "/nonexistent"), "no model at /nonexistent"),
        (("demo", "--device", "cpu", "--context", "100000", "--new-tokens", "3", "--runs", "1"),
         "use a shorter context"),
    ]  # fmt: skip
    for args, words in cases:
        r = cli(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "python -m torch_sm70attn demo: error: " in r.stderr and words in r.stderr, r.stderr
        assert "--debug demo" in r.stderr, r.stderr
    r = cli("--debug", *cases[0][0])
    assert r.returncode == 1 and "Traceback" in r.stderr and "FileNotFoundError" in r.stderr


def test_a_demo_context_too_long_says_the_largest_it_can_take():
    """`demo --context 10000000` said "use a shorter context" and not how short: the largest
    prompt the shipped text gives, which is then accepted."""
    from helpers_cli import cli

    from torch_sm70attn.integrations import shipped

    r = cli("demo", "--device", "cpu", "--context", "10000000", "--new-tokens", "3")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    largest = re.search(r"use a shorter context, at most (\d+) tokens", r.stderr)
    assert largest, r.stderr
    _, tok = shipped.load("cpu")
    stream = shipped.own_source(tok)
    n = int(largest[1])
    assert shipped.continuations(stream, shipped.eot_id(tok), n, 1).shape == (1, n)
    with pytest.raises(ValueError, match=f"at most {n} tokens"):
        shipped.continuations(stream, shipped.eot_id(tok), n + 1, 1)


def test_demo_names_a_near_tie_at_the_first_difference():
    """The demo's line at a request's first token that differs from stock's: stock's gap there,
    as a share of its logits' range, a near tie under 1%."""
    from torch_sm70attn.integrations import demo

    step = torch.tensor([0.0, 5.0, 4.99, -3.0])
    assert demo._tie(step, 1, 2, 7) == (
        "first different token at step 7: stock's logit for its token 1 is 0.01 above its logit "
        "for ours (2), 0.13% of its logits' range: a near tie"
    )
    assert demo._tie(step, 1, 0, 7).endswith("62.50% of its logits' range: more than a near tie: "
                                              "the FP8 cache's rounding of K and V (docs/quality.md)")  # fmt: skip


def test_cli_demo_prints_the_shipped_models_completion():
    """The demo on a CPU: the shipped model continues this package's own code, and the text it
    prints for stock float16 is the decode of stock greedy generation on the same prompts
    (generated here again), and its own is that text when all tokens agree."""
    from helpers_cli import cli

    from torch_sm70attn.integrations import demo, shipped

    r = cli("demo", "--device", "cpu", "--context", "512", "--new-tokens", "12", "--batch", "2",
            "--runs", "1")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "route of a decode step: reference" in out
    assert "(medians of 1 warm runs; decode after the prompt)" in out, out
    for line in ("stock sdpa, fp16 cache", "sm70attn, decode", "sm70attn, prompt lookup 4"):
        assert line in out, out
    assert "timings on a CPU say nothing about a GPU" in out
    agreed = re.search(
        r"before the first difference: (\d+) of 12, (\d+) of 12 \(per request\)", out
    )
    assert agreed, out
    for b, a in enumerate(agreed.groups()):  # a difference comes with stock's gap there
        note = re.search(rf"request {b}: first different token at step (\d+): .*: (.*)", out)
        assert (note is None) == (a == "12"), out
        assert note is None or (note[1] == a and note[2] == "a near tie"), out
    assert "prompt lookup 4 emitted the greedy tokens in this run: " in out, out
    ours = out.split("--- torch_sm70attn (paged E4M3 cache) continues ---\n")[1]
    ours, _, stock = ours.partition("\n--- stock float16 continues")
    stock = ours if stock.startswith(": the same text") else stock.split("---\n", 1)[1]
    model, tok = shipped.load("cpu")
    ids = shipped.continuations(shipped.own_source(tok), shipped.eot_id(tok), 512, 2)
    want, _, _ = demo.timed_generate(model, ids, None, 12)
    assert stock.rstrip("\n") == tok.decode(want[0]).rstrip("\n"), (stock, tok.decode(want[0]))
    assert (ours == stock) == (int(agreed[1]) == 12)


def test_cache_pages_slots_and_stored_values():
    """update() gives request b of B the pages b * W .. (b + 1) * W - 1 (W = pages / B), writes
    e4m3(x / scale) at page * page_size + offset, and gives the attention its table, lengths
    and scales (the whole table, and the pages in use for the prefill route); crop lets the next
    write reuse the slots of rejected tokens."""
    cfg = tiny(vocab=64, hidden=128, heads=4, head_dim=64)
    cache = hf.PagedE4M3Cache(
        cfg, max_tokens=96, max_batch_size=2, page_size=16, k_scale=0.5, v_scale=[0.25, 0.5]
    )
    g = torch.Generator().manual_seed(0)

    def step(Q):
        kv = [torch.randn(2, 2, Q, 64, generator=g).half() for _ in "kv"]
        got = {}
        for layer in range(2):
            kw = {}
            cache.update(*kv, layer, kwargs=kw)
            assert kw[hf.NAME] == (cache, layer)
            got[layer] = cache.store(layer, *kv, None)  # what the attention does
        return kv, got

    (k, _), got = step(20)  # a prompt of 20 tokens: 6 pages, 3 per request, 2 of them in use
    layer, plan = got[1]
    assert plan.pages == 2 and plan.lens.tolist() == [20, 20]
    assert plan.table.tolist() == [[0, 1, 2], [3, 4, 5]] and plan.rows == 20
    assert plan.slots.view(2, 20)[1, 19] == 4 * 16 + 3 and got[0][1] is plan  # layer 0's plan
    assert layer.k_scale.tolist() == [0.5, 0.5] and layer.v_scale.tolist() == [0.5, 0.5]
    want = (k[1, :, 19].float() / 0.5).to(FP8)  # request 1, position 19: page 4, offset 3
    assert torch.equal(layer.keys[4, 3].view(torch.uint8), want.view(torch.uint8))
    assert cache.plan is None  # the forward is over
    (k, _), got = step(4)  # 4 more: positions 20..23, same pages
    plan = got[0][1]
    assert plan.pages is None and plan.lens.tolist() == [24, 24] and cache.get_seq_length() == 24
    cache.crop(-3)  # reject 3: the next token is position 21, in the slot of a rejected one
    (k, _), got = step(1)
    assert got[0][1].lens.tolist() == [22, 22]
    want = (k[0, :, 0].float() / 0.5).to(FP8)
    assert torch.equal(cache.layers[0].keys[1, 5].view(torch.uint8), want.view(torch.uint8))
    _, got = step(11)  # 33 tokens: the 3rd page of each request
    plan = got[0][1]
    assert plan.pages is None and plan.lens.tolist() == [33, 33]  # pages: the prefill route's
    with pytest.raises(RuntimeError, match="use max_tokens >= 128; nothing was stored"):
        step(17)  # a prefill of 17 rows: 50 > 48 tokens per request, refused before storing
    assert cache.get_seq_length() == 33  # the refused step changed nothing
    before = cache.layers[0].keys.clone()
    step(16)  # a verify step of 16 rows (49 > 48): checked on the device, not stored
    assert torch.equal(cache.layers[0].keys.view(torch.uint8), before.view(torch.uint8))
    with pytest.raises(RuntimeError, match=r"request\(s\) \[0, 1\] went past their 48 tokens"):
        cache.get_seq_length()  # the next host read raises
    assert cache.get_seq_length() == 48  # raised once; the lengths stopped at the capacity


def test_compiled_decode_and_verify_steps_have_no_graph_break(model):
    """The forward compiled whole (fullgraph=True: a graph break is an error) for decode steps,
    a verify step of 4 rows, a crop and more decode: the same logits as eager, one graph per
    query width, each storing and attending through the ops in both layers. No position_ids
    are passed, so the model asks the cache for its length inside the graph."""
    backend, graphs = counting_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def run(fwd):
        cache, out = paged(model), []
        with torch.no_grad():
            tok = model(prompt(), cache=cache).logits[:, -1:].argmax(-1)  # the prompt: eager
            for ids in [tok] * 3 + [tok.repeat(1, 4)] + ["crop"] + [tok] * 2:
                if isinstance(ids, str):
                    cache.crop(-3)
                    continue
                out.append(fwd(ids, cache=cache).logits)
        return out, cache.get_seq_length()

    want, n_want = run(model)
    got, n_got = run(compiled)
    assert n_got == n_want == 30 + 3 + 4 - 3 + 2
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    ops = ["sm70attn.paged_attention.default"] * 2 + ["sm70attn.store_kv.default"] * 2
    assert graphs == [ops, ops], graphs  # Q 1 and Q 4


def test_whole_model_compiled_prompt_traces_whole_through_the_varlen_op(model, caplog):
    """torch.compile(model, backend="sm70attn") over the whole model, the prompt compiled too
    (fullgraph: a graph break is an error). Given scales are checked when the cache is made, so
    the first forward reads no scale data (it broke the graph in `paging.device_scale`); the
    prompt's attention (more rows than the decode kernels take) is paged_attention_varlen in
    the graph, no SDPA left for the pass to keep or refuse. The prompt's and the decode steps'
    logits equal eager's."""
    import logging

    from torch._dynamo.utils import counters

    backend, graphs = counting_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def run(fwd):
        vs = [torch.tensor(0.04), torch.tensor([0.06, 0.05])]  # a checkpoint's are tensors
        cache = hf.PagedE4M3Cache(model.config, max_tokens=256, k_scale=0.05, v_scale=vs)
        with torch.no_grad():
            out = [fwd(prompt(), cache=cache).logits]
            for _ in range(2):
                out.append(fwd(out[-1][:, -1:].argmax(-1), cache=cache).logits)
        return out

    want = run(model)
    counters["sm70attn"].clear()
    with caplog.at_level(logging.WARNING, logger="torch_sm70attn"):
        got = run(compiled)
    assert not [r for r in caplog.records if "slow gather path" in r.getMessage()], caplog.text
    assert counters["sm70attn"]["sdpa_prefill_kept"] == 0
    assert counters["sm70attn"]["sdpa_refused"] == 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-3)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    assert len(graphs) == 2  # the prompt, one decode step
    assert graphs[0].count("sm70attn.paged_attention_varlen.default") == 2, graphs[0]  # 2 layers
    assert "sm70attn.paged_attention.default" not in graphs[0]
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        hf.PagedE4M3Cache(model.config, k_scale=[0.05, -1.0])


def test_generate_compiled_equals_eager(model):
    """generate(compile_config=...) with fullgraph=True: decode steps in one graph, prompt
    lookup's verify steps in one graph per width; the same tokens as eager generate with the
    same steps. (Not as greedy: a verify forward's 5-row GEMMs round differently from a decode
    forward's, so an exact fp16 tie can break the other way; on one AMD EPYC host, step 16 of
    this prompt has logits 0.833984375 for tokens 106 and 129. Prompt lookup against greedy is
    test_prompt_lookup_verify_steps_emit_the_greedy_tokens, on a prompt without ties.)"""
    from transformers import CompileConfig

    ids = prompt(seed=8)
    for lookup in (None, 4):
        want = generate(model, ids, paged(model), prompt_lookup_num_tokens=lookup)
        backend, graphs = counting_backend()
        config = CompileConfig(fullgraph=True, backend=backend, mode=None)
        config._compile_all_devices = True  # transformers compiles only on GPUs otherwise
        got = generate(
            model, ids, paged(model), compile_config=config, prompt_lookup_num_tokens=lookup
        )
        assert torch.equal(got, want)
        assert len(graphs) == 1 if lookup is None else 1 < len(graphs) <= lookup + 1, graphs


def test_eager_and_compiled_steps_give_the_op_the_same_table(model, monkeypatch):
    """The op's split count follows its block table's capacity, so eager and compiled steps
    must pass the same table to compute the same bits (on a GPU; the CPU reference has no
    splits): the whole table in both, whatever the pages in use."""
    widths = {"eager": set(), "compiled": set()}
    paged_attention = sa.paged_attention

    def recording(query, kc, vc, table, *args, **kw):
        mode = "compiled" if torch.compiler.is_compiling() else "eager"
        widths[mode].add(table.shape[1])
        return paged_attention(query, kc, vc, table, *args, **kw)

    monkeypatch.setattr(hf.sa, "paged_attention", recording)
    backend, _ = counting_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for fwd in (model, compiled):
        cache = paged(model)
        with torch.no_grad():
            tok = model(prompt(), cache=cache).logits[:, -1:].argmax(-1)
            for ids in [tok, tok.repeat(1, 4), tok]:
                fwd(ids, cache=cache)
    whole = paged(model).num_pages  # batch 1: every page
    assert widths == {"eager": {whole}, "compiled": {whole}}, widths


class _GatherLayer(CacheLayerMixin):
    is_compileable = True

    def __init__(self, cache):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, *args, **kwargs):
        raise NotImplementedError

    def get_seq_length(self):
        return self.cache.n

    def get_mask_sizes(self, query_length):
        return self.cache.capacity, 0

    def get_max_length(self):
        return self.cache.capacity


class GatherCache(Cache):
    """A user's FP8 cache for transformers' stock `sdpa` attention: paged E4M3 pools written
    with the quantizing idiom, read back gathered and dequantized (the users' FP8 path)."""

    def __init__(self, pages=32, page=16, width=4):
        self.page, self.n, self.capacity = page, 0, width * page
        shape = (pages, page, 2, 128)
        self.kc = [torch.zeros(shape, dtype=FP8) for _ in range(2)]
        self.vc = [torch.zeros(shape, dtype=FP8) for _ in range(2)]
        self.table = torch.arange(width, dtype=torch.int32).view(1, width)
        super().__init__(layers=[_GatherLayer(self) for _ in range(2)])

    def get_seq_length(self, layer_idx=0):
        return self.n

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        B, H, Q, D = key_states.shape
        pos = torch.arange(Q) + self.n
        slots = (self.table[:, pos // self.page].long() * self.page + pos % self.page).flatten()
        out = []
        for x, pool, s in ((key_states, self.kc, KS), (value_states, self.vc, VS)):
            x = x.transpose(1, 2).reshape(-1, H, D)
            pool[layer_idx].view(-1, H, D)[slots] = (x.float() / s).clamp(-448, 448).to(FP8)
            out.append(
                (pool[layer_idx][self.table.long()].flatten(1, 2).half() * s).transpose(1, 2)
            )
        if layer_idx == len(self.layers) - 1:
            self.n += Q
        return out[0], out[1]


def test_stock_sdpa_over_a_gathering_cache_is_rewritten(model):
    """transformers' own sdpa attention (its mask: kv_arange <= arange(Q) + past, expanded over
    the batch) over a cache that gathers and dequantizes pages: the backend rewrites every
    attention and cache write, decode and verify, with the offset an int, then a SymInt; the
    logits equal eager's."""
    from torch._dynamo.utils import counters

    ids = prompt()
    model.set_attn_implementation("sdpa")
    try:
        backend, _ = counting_backend()
        counters.clear()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        runs = []
        for fwd in (model, compiled):
            cache, out = GatherCache(), []
            with torch.no_grad():
                model(ids, cache=cache)  # the prompt, eager
                for Q in (1, 1, 4, 1):
                    out.append(fwd(ids[:, :Q], cache=cache).logits)
            runs.append(out)
    finally:
        model.set_attn_implementation(hf.NAME)
    for got, want in zip(runs[1], runs[0], strict=True):
        assert rel_err(got, want.double()) < 1e-2
    c = counters["sm70attn"]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 3  # the offset static, then symbolic; then 4 rows
    assert c["paged_attention_rewrite"] == c["store_kv_rewrite"] == 2 * graphs, dict(c)
    assert not c.get("sdpa_refused") and not c.get("store_refused"), dict(c)
