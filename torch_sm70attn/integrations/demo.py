"""`python -m torch_sm70attn demo`: a Qwen3-architecture model (transformers' own classes,
random seeded weights, no download) generating from a long prompt through the paged E4M3
cache: prefill, plain decode and prompt-lookup speculative decoding (verify steps of several
rows), against transformers' stock SDPA path with its default float16 cache."""

from __future__ import annotations

import time

import torch

import torch_sm70attn as sa

# (hidden, layers, query heads, KV heads, head dim, vocab): a tiny model for a CPU, and on a
# GPU the seeds' geometry (head dim 256, 6 query heads per KV head)
TINY = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
REAL = dict(hidden_size=2048, num_attention_heads=12, num_key_value_heads=2, head_dim=256)


def _say(msg: str) -> None:
    print(msg, flush=True)


def build(device: torch.device, layers: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from .transformers import register

    register()
    geo = REAL if device.type == "cuda" else TINY
    cfg = Qwen3Config(
        vocab_size=1024,
        intermediate_size=2 * geo["hidden_size"],
        num_hidden_layers=layers,
        max_position_embeddings=1 << 20,
        **geo,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float16)
    return model.to(device).eval()


def make_prompt(batch: int, context: int, device, seed: int = 0):
    """Random tokens with a repeated stretch, so that prompt lookup finds drafts."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 1024, (batch, 256), generator=g)
    reps = -(-context // base.shape[1])
    return base.repeat(1, reps)[:, :context].to(device)


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _generate(model, ids, cache, new_tokens, compile_config=None, **kw):
    """Greedy generate; returns (sequences, per-step logits, (prompt s, after-prompt s)): the
    first forward (the prompt, with the first drafts under prompt lookup) is timed apart."""
    marks = []

    def first(*_):  # the prompt's end; then gone, so that compiled steps trace no hook
        marks.append(_now(ids.device))
        hook.remove()

    hook = model.register_forward_hook(first)
    t0 = _now(ids.device)
    try:
        with torch.no_grad():
            out = model.generate(
                ids,
                cache=cache,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                compile_config=compile_config,
                disable_compile=compile_config is None,  # eager unless asked
                **kw,
            )
    finally:
        hook.remove()
    t1 = _now(ids.device)
    return out.sequences, torch.stack(out.logits, 1).float(), (marks[0] - t0, t1 - marks[0])


def run(device: torch.device, context: int, batch: int, layers: int, draft: int, new: int) -> int:
    from .transformers import NAME, PagedE4M3Cache

    if device.type == "cuda":
        _say("building (or loading) the CUDA kernels; the first build takes about a minute ...")
        t0 = time.perf_counter()
        sa.ops.load_cuda_kernels()
        _say(f"  ready in {time.perf_counter() - t0:.1f} s")
    model = build(device, layers)
    cfg = model.config
    _say(
        f"device {device}; Qwen3 architecture, random weights: {layers} layers, "
        f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, head dim "
        f"{cfg.head_dim}; batch {batch}, prompt {context} tokens, {new} new tokens"
    )
    ids = make_prompt(batch, context, device)
    q = torch.empty(1, cfg.num_attention_heads, 1, cfg.head_dim, dtype=torch.float16, device=device)
    kc = torch.empty(
        1, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float8_e4m3fn, device=device
    )
    route = sa.admit(q, kc)
    _say(f"route of a decode step: {route.route} ({route.reason})")

    def cache():
        return PagedE4M3Cache(cfg, max_tokens=context + new + draft + 16, max_batch_size=batch)

    model.set_attn_implementation("sdpa")
    _say("stock transformers (sdpa attention, float16 DynamicCache) ...")
    _generate(model, ids, None, 2)  # warm-up
    ref, ref_logits, t_ref = _generate(model, ids, None, new)
    model.set_attn_implementation(NAME)
    _say("torch_sm70attn (paged E4M3 cache) ...")
    _generate(model, ids, cache(), 2)  # warm-up: the first calls build, tune, allocate
    ours, logits, t_ours = _generate(model, ids, cache(), new)
    spec_rows = []
    paged = sa.paged_attention

    def counting(query, *args, **kw):
        spec_rows.append(query.shape[2])
        return paged(query, *args, **kw)

    def line(name, t):  # the prompt's time, and tokens/s after it
        _say(f"{name:<30} {t[0]:9.3f} {batch * (new - 1) / t[1]:16.1f}")

    compiled = None
    if device.type == "cuda":  # generate's decode steps as one graph each, CUDA graphs
        from .transformers import compile_config

        _say("torch_sm70attn compiled (fullgraph, the backend's CUDA graphs): compiling ...")
        config = compile_config(mode=None, options={"inner": "cudagraphs"})  # a V100's path
        c = cache()  # one cache, reset: the timed run replays the graphs recorded before
        _generate(model, ids, c, new, compile_config=config)  # compile, warm up, record
        c.reset()
        compiled = _generate(model, ids, c, new, compile_config=config)
        if batch == 1:
            lookup = dict(compile_config=config, prompt_lookup_num_tokens=draft)
            c.reset()
            _generate(model, ids, c, new, **lookup)  # a graph per verify width
            c.reset()
            compiled_lookup = _generate(model, ids, c, new, **lookup)
    _say(f"{'path':<30} {'prompt s':>9} {'decode tokens/s':>16}")
    line("stock sdpa, fp16 cache", t_ref)
    line("sm70attn, decode", t_ours)
    if compiled is not None:
        line("sm70attn, decode, compiled", compiled[2])
        if not torch.equal(compiled[0], ours):
            _say("compiled decode differs from eager decode: a bug, please report it")
            return 1
    if batch == 1:  # transformers' assisted generation takes one request
        _generate(model, ids, cache(), 2 + draft, prompt_lookup_num_tokens=draft)  # warm-up
        sa.paged_attention = counting  # count the verify steps
        try:
            spec, _, t_spec = _generate(model, ids, cache(), new, prompt_lookup_num_tokens=draft)
        finally:
            sa.paged_attention = paged
        steps = len(spec_rows) // layers
        line(f"sm70attn, prompt lookup {draft}", t_spec)
        if compiled is not None:
            line(f"sm70attn, prompt lookup {draft}, compiled", compiled_lookup[2])
            if not torch.equal(compiled_lookup[0], ours):
                _say("compiled prompt lookup differs from greedy decode: a bug, please report it")
                return 1
        _say(
            f"prompt lookup: {steps} verify steps after the prompt for {new} tokens "
            f"({new / max(steps, 1):.2f} tokens per step; up to {max(spec_rows)} rows a step)"
        )
    n = min(ref.shape[1], ours.shape[1])
    diff = (ref[:, :n] != ours[:, :n]).nonzero()
    first = int(diff[:, 1].min()) - context if diff.numel() else None
    upto = first if first is not None else new  # logits compared while the inputs agree
    scale = ref_logits[:, : max(upto, 1)].abs().amax().item()
    dev = (ref_logits[:, : max(upto, 1)] - logits[:, : max(upto, 1)]).abs().amax().item()
    _say(
        f"largest logit deviation from the stock path: {dev:.3g} (of logits up to {scale:.3g}) "
        f"over the first {max(upto, 1)} steps; first differing token: "
        f"{'none' if first is None else first}"
    )
    _say(
        "(the FP8 KV cache rounds K and V to 3 mantissa bits, so small deviations, and on a "
        "random model's near-ties a different token, are expected)"
    )
    if batch == 1:
        d = (spec != ours).nonzero()
        same = "yes" if not d.numel() else f"no, from token {int(d[:, 1].min()) - context}"
        _say(f"prompt lookup emits the greedy tokens: {same}")
    return 0 if bool(torch.isfinite(logits).all()) else 1
