"""The transformers integration on the GPU at the seeds' geometry (head dim 256, 6 query heads
per KV head, from `demo.build`): the paged cache against the stock SDPA path over the same
quantized values for a prompt, decode and verify rows, and generate() compiled whole-graph
(fullgraph=True) with CUDA graphs: the same tokens as eager, one graph for decode, one per
verify width, no cudagraph skips."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import helpers_transformers  # noqa: E402
from oracle import rel_err  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig  # noqa: E402

import torch_sm70attn as sa  # noqa: E402
from torch_sm70attn.integrations import demo  # noqa: E402
from torch_sm70attn.integrations import transformers as hf  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
KS, VS = 0.05, 0.04
CTX = 4096


@pytest.fixture(scope="module")
def model():
    sa.ops.load_cuda_kernels()
    return demo.build(DEV, layers=2)


def paged(model, batch=1):
    return hf.PagedE4M3Cache(
        model.config, max_tokens=batch * (CTX + 256), max_batch_size=batch, k_scale=KS, v_scale=VS
    )


class QuantizedDynamicCache(helpers_transformers.QuantizedDynamicCache):
    ks, vs = KS, VS  # the scales of this file's paged caches


def test_prompt_decode_verify_match_stock_sdpa_over_the_same_values(model, record):
    """Forward by forward, with logits compared: the prompt (prefill route), one decode row,
    8 verify rows, a crop of 5 and one more decode row."""
    ids = demo.make_prompt(2, CTX + 1 + 8 + 1, DEV, seed=3)
    chunks = [ids[:, :CTX], ids[:, CTX : CTX + 1], ids[:, CTX + 1 : CTX + 9]]
    ours, stock = paged(model, batch=2), QuantizedDynamicCache()
    worst = 0.0
    with torch.no_grad():
        for i, chunk in enumerate(chunks + [ids[:, CTX + 9 :]]):
            if i == 3:  # reject the last 5 verify rows on both sides
                ours.crop(-5)
                stock.crop(-5)
            model.set_attn_implementation("sdpa")
            want = model(chunk, cache=stock).logits
            model.set_attn_implementation(hf.NAME)
            got = model(chunk, cache=ours).logits
            assert torch.isfinite(got).all()
            worst = max(worst, rel_err(got, want.double()))
    assert ours.get_seq_length() == stock.get_seq_length() == CTX + 1 + 8 - 5 + 1
    assert worst < 1e-2, worst
    record("hf forwards vs stock sdpa", worst, f"head dim 256, G 6, {CTX} prompt, B 2")


def generate(model, ids, cache, config=None, **kw):
    """Greedy; compiled with `config`, else eager (transformers would compile a compileable
    cache's decode steps with its default config on a GPU)."""
    with torch.no_grad():
        return model.generate(
            ids,
            cache=cache,
            max_new_tokens=24,
            do_sample=False,
            compile_config=config,
            disable_compile=config is None,
            **kw,
        )


@pytest.mark.parametrize("prompt_lookup", [None, 4])
def test_generate_compiled_fullgraph_with_cuda_graphs(model, prompt_lookup, record):
    """generate()'s compiled forward through the sm70attn backend's own CUDA graphs (the V100's
    path: the same kernels and plans as eager, so the same tokens as eager generate with the
    same steps). fullgraph=True: a graph break is an error. Prompt lookup against greedy:
    test_prompt_lookup_keeps_the_greedy_tokens_up_to_a_near_tie."""
    model.set_attn_implementation(hf.NAME)
    ids = demo.make_prompt(1, CTX, DEV, seed=4)
    want = generate(model, ids, paged(model), prompt_lookup_num_tokens=prompt_lookup)
    torch._dynamo.reset()
    counters.clear()
    config = hf.compile_config(mode=None, options={"inner": "cudagraphs"})
    got = generate(model, ids, paged(model), config, prompt_lookup_num_tokens=prompt_lookup)
    assert torch.equal(got, want), (got[0, CTX:], want[0, CTX:])
    graphs = counters["stats"]["unique_graphs"]
    recordings = counters["sm70attn"]["cuda_graph_recordings"]
    skips = counters["sm70attn"]["cuda_graph_skips"]
    assert skips == 0 and recordings >= 1
    if prompt_lookup is None:
        assert graphs == 1, graphs  # every decode step replays one graph
    else:
        assert graphs <= prompt_lookup + 1, graphs  # one per verify width (1 .. draft + 1 rows)
    record(
        f"hf generate compiled{' lookup' if prompt_lookup else ''}",
        0.0,
        f"{graphs} graphs, {recordings} recordings, {skips} skips, tokens equal to eager",
    )


def test_prompt_lookup_keeps_the_greedy_tokens_up_to_a_near_tie(model, record):
    """A verify step computes a row's logits with other kernels and splits than a decode step
    (several rows per CTA), so the bits differ at rounding level and a near tie between two
    tokens can break the other way: prompt lookup keeps greedy's tokens in exact arithmetic
    only. Its tokens must equal greedy's up to the first step where greedy's two best logits
    are within 1% of the logits' range; from there on it is another continuation."""
    model.set_attn_implementation(hf.NAME)
    ids = demo.make_prompt(1, CTX, DEV, seed=4)
    with torch.no_grad():
        g = model.generate(
            ids,
            cache=paged(model),
            max_new_tokens=24,
            do_sample=False,
            disable_compile=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    greedy = g.sequences[0, CTX:]
    spec = generate(model, ids, paged(model), prompt_lookup_num_tokens=4)[0, CTX:]
    assert spec.shape == greedy.shape
    record("hf prompt lookup vs greedy", 0.0, helpers_transformers.near_tie(spec, greedy, g.logits))


@pytest.mark.parametrize("which", ["transformers", "sm70attn"])
def test_generate_with_inductor_and_cuda_graph_trees(model, which, record):
    """transformers' default CompileConfig (inductor, mode reduce-overhead; what generate()
    uses on a GPU when given none) and `compile_config()` (the sm70attn backend, which on this
    GPU hands the graph to inductor), with fullgraph: the attention calls the op, so nothing
    needs rewriting; logits close to eager while the tokens agree (inductor fuses the norms
    and rounds differently)."""
    model.set_attn_implementation(hf.NAME)
    ids = demo.make_prompt(1, CTX, DEV, seed=5)
    kw = dict(output_logits=True, return_dict_in_generate=True)
    want = generate(model, ids, paged(model), **kw)
    torch._dynamo.reset()
    counters.clear()
    config = CompileConfig(fullgraph=True) if which == "transformers" else hf.compile_config()
    got = generate(model, ids, paged(model), config, **kw)
    a, b = got.sequences[0, CTX:], want.sequences[0, CTX:]
    differ = (a != b).nonzero()
    n = int(differ[0]) + 1 if differ.numel() else len(a)  # steps whose inputs agree
    err = rel_err(torch.stack(got.logits[:n]), torch.stack(want.logits[:n]).double())
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert err < 2e-2 and n >= 8, (err, n)
    record(f"hf generate {which} inductor", err, f"tokens agree for {n} of {len(a)} steps")


# --- concurrent requests of different lengths (issue 23) ---------------------------------------
LENGTHS = (400, 4000, 1300, 2700, 650, 3300, 900, 2000)  # 10x apart
CAP = 4096 + 256  # tokens of pages per request, alone and in the batch: the same splits


def left_padded(lengths, seed=6):
    ids = demo.make_prompt(len(lengths), max(lengths), DEV, seed=seed)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, -n:] = 1
        ids[b, :-n] = 0
    return ids, mask


def capped(model, batch):
    return hf.PagedE4M3Cache(
        model.config, max_tokens=batch * CAP, max_batch_size=batch, k_scale=KS, v_scale=VS
    )


@pytest.mark.parametrize("compiled", [False, True])
def test_batch_of_8_different_lengths_equals_each_request_alone(model, compiled, record):
    """8 left-padded requests of 400 to 4000 tokens: each request's 24 tokens equal that request
    generated alone (same scales, same pages per request), eager and compiled with the backend's
    CUDA graphs, up to the first near tie: the attention is bitwise the same batched and alone
    (test_cuda.py), the model's matrix products of 8 rows and of 1 are not
    (helpers_transformers.near_tie)."""
    model.set_attn_implementation(hf.NAME)
    ids, mask = left_padded(LENGTHS)
    config = hf.compile_config(mode=None, options={"inner": "cudagraphs"}) if compiled else None
    torch._dynamo.reset()
    with torch.no_grad():
        got = model.generate(
            ids, attention_mask=mask, cache=capped(model, 8), max_new_tokens=24,
            do_sample=False, compile_config=config, disable_compile=config is None,
        )[:, ids.shape[1] :]  # fmt: skip
    notes = []
    for b, n in enumerate(LENGTHS):
        kw = dict(output_logits=True, return_dict_in_generate=True)
        alone = generate(model, ids[b : b + 1, -n:], capped(model, 1), config, **kw)
        notes.append(helpers_transformers.near_tie(got[b], alone.sequences[0, n:], alone.logits))
    equal = notes.count("tokens equal")
    record(
        f"hf batch of 8 {'compiled' if compiled else 'eager'}",
        0.0,
        f"lengths {min(LENGTHS)}-{max(LENGTHS)}: {equal} of 8 requests' 24 tokens equal to alone"
        + "".join(f"; request {b}: {x}" for b, x in enumerate(notes) if x != "tokens equal"),
    )


def test_speculative_batch_compiled_equals_eager_and_greedy(model, record):
    """The batched verify loop (prompt lookup, 7 drafts, per-request acceptance) on 4 requests
    of different lengths: compiled verify steps (backend CUDA graphs) give the eager loop's
    tokens; each request's tokens are its greedy tokens alone up to the first near tie (a verify
    step's rows round otherwise than decode steps' rows: helpers_transformers.near_tie)."""
    from torch_sm70attn.integrations import speculative

    model.set_attn_implementation(hf.NAME)
    lengths = LENGTHS[:4]
    ids, mask = left_padded(lengths, seed=7)
    want = speculative.generate(model, ids, mask, cache=capped(model, 4), max_new_tokens=32)
    torch._dynamo.reset()
    fwd = torch.compile(
        model, backend=hf.NAME, fullgraph=True, dynamic=False, options={"inner": "cudagraphs"}
    )
    got = speculative.generate(
        model, ids, mask, cache=capped(model, 4), max_new_tokens=32, forward=fwd
    )
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    notes = []
    for b, n in enumerate(lengths):
        g = generate(
            model,
            ids[b : b + 1, -n:],
            capped(model, 1),
            output_logits=True,
            return_dict_in_generate=True,
        )
        notes.append(
            helpers_transformers.near_tie(got.tokens[b][:24], g.sequences[0, n:], g.logits)
        )
    record(
        "hf speculative batch of 4",
        0.0,
        f"{got.steps} steps for 32 tokens, accepted {sum(got.accepted) / got.steps:.2f} drafts "
        f"a step; against greedy alone: {'; '.join(notes)}",
    )


def test_serve_compiled_equals_eager_one_graph(model, record):
    """Continuous batching (speculative.serve): 8 requests of 400-4000 tokens through 3 slots,
    each joining as a slot frees (its prompt alone, through cache.request(slot)). Compiled
    verify steps (backend CUDA graphs) give the eager loop's tokens in one graph, with no
    recompile as requests come and go; each request's tokens are its greedy tokens alone up to
    the first near tie."""
    from torch_sm70attn.integrations import speculative

    model.set_attn_implementation(hf.NAME)
    ids, mask = left_padded(LENGTHS, seed=8)
    prompts = [ids[b, -n:] for b, n in enumerate(LENGTHS)]
    want = speculative.serve(model, prompts, cache=capped(model, 3), max_new_tokens=24)
    torch._dynamo.reset()
    counters.clear()
    fwd = torch.compile(
        model, backend=hf.NAME, fullgraph=True, dynamic=False, options={"inner": "cudagraphs"}
    )
    got = speculative.serve(model, prompts, cache=capped(model, 3), max_new_tokens=24, forward=fwd)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    notes = []
    for b, p in enumerate(prompts):
        kw = dict(output_logits=True, return_dict_in_generate=True)
        g = generate(model, p[None], capped(model, 1), **kw)
        notes.append(
            helpers_transformers.near_tie(got.tokens[b], g.sequences[0, p.numel() :], g.logits)
        )
    record(
        "hf serve 8 requests, 3 slots",
        0.0,
        f"{got.steps} steps for 8 x 24 tokens; against greedy alone: "
        f"{notes.count('tokens equal')} of 8 equal"
        + "".join(f"; request {b}: {x}" for b, x in enumerate(notes) if x != "tokens equal"),
    )
