"""Batched speculative decoding for transformers models on a PagedE4M3Cache: each request of
a batch drafts its own tokens (prompt lookup, or an assistant model), one verify forward
checks B x (drafts + 1) rows, each request accepts its own number of drafts (greedy
acceptance) and the cache crops each request apart (`crop` with a tensor), so the batch stays on the device and in one graph per
width. transformers' own assisted generation takes one request; this is the loop for several.

    cache = PagedE4M3Cache(model.config, max_tokens=B * (prompt + new + 16), max_batch_size=B)
    out = speculative.generate(model, ids, mask, cache=cache, max_new_tokens=256, drafts=7)
    out.tokens[b]  # request b's new tokens; out.accepted: drafts accepted per step

A step's input per request is its last emitted token (not yet in the cache) and its drafts;
the verify logits give the greedy token after each; request b accepts the drafts up to the
first mismatch (a_b of them) and emits a_b + 1 tokens. Greedy acceptance emits the tokens
greedy decoding would, up to near-ties: a verify forward's GEMMs have more rows than a
decode step's and round differently, so where two logits are within about 1e-3 the argmax
can differ from a one-row step's. The tokens of one run are checked against greedy by
tests/test_transformers_batch.py (CPU) and tests/test_transformers_cuda.py (GPU), not
promised.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .transformers import positions


@dataclasses.dataclass
class Output:
    tokens: list[torch.Tensor]  # per request, its new tokens (CPU int64)
    steps: int  # verify forwards after the prompt
    accepted: list[float]  # per step, the mean accepted drafts over the running requests
    emitted: list[list[int]]  # per step, the tokens each request emitted (the prompt's first)
    times: list[float]  # per step, host clock (s) once its tokens were on the host


def prompt_lookup(tokens: torch.Tensor, k: int, max_ngram: int = 3) -> torch.Tensor:
    """Up to k drafts: what followed the latest earlier occurrence of the last n tokens
    (n = max_ngram .. 1) in `tokens` (1-D CPU int64). Empty if nothing matches."""
    L = tokens.numel()
    for n in range(min(max_ngram, L - 1), 0, -1):
        windows = tokens[: L - 1].unfold(0, n, 1)  # every n-gram that has a successor
        hits = (windows == tokens[L - n :]).all(1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    cache,
    max_new_tokens: int,
    drafts: int = 7,
    forward=None,
    eos_token_id: int | list[int] | None = None,
    max_ngram: int = 3,
    assistant=None,
    assistant_cache=None,
    assistant_forward=None,
) -> Output:
    """Greedy generation of max_new_tokens per request (fewer where eos_token_id comes first)
    with verify steps of drafts + 1 rows. input_ids [B, T], left padded where attention_mask
    [B, T] has zeros. cache: an empty PagedE4M3Cache with max_batch_size >= B; the prompt is
    refused before anything is stored unless each request's prompt + max_new_tokens + drafts
    fits. forward: what runs the verify steps (default: the model; e.g. torch.compile(model,
    backend="sm70attn", fullgraph=True, mode="reduce-overhead")); the prompt runs eagerly.
    assistant: a smaller model of the same vocabulary that drafts greedily instead of prompt
    lookup, with its own empty PagedE4M3Cache (assistant_cache) and optionally a compiled
    forward (assistant_forward); it runs drafts + 1 forwards of one row a step (the last
    stores the last draft), so its cache holds what the model's does and both crop alike."""
    if max_new_tokens < 1 or drafts < 1:
        raise ValueError("speculative.generate: need max_new_tokens >= 1 and drafts >= 1")
    eos = set() if eos_token_id is None else set(torch.tensor(eos_token_id).reshape(-1).tolist())
    forward = model if forward is None else forward
    B, dev = input_ids.shape[0], input_ids.device
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(dev)
    logits = _prompt(model, input_ids, mask, cache, max_new_tokens + drafts)
    if assistant is not None:
        if assistant_cache is None:
            raise ValueError("speculative.generate: an assistant needs its own assistant_cache")
        _prompt(assistant, input_ids, mask, assistant_cache, max_new_tokens + drafts)
        assistant_forward = assistant if assistant_forward is None else assistant_forward
    last = logits[:, -1].argmax(-1).cpu()
    times, emitted = [time.perf_counter()], [[1] * B]
    history = [input_ids[b][mask[b].bool()].cpu() for b in range(B)]
    out = [[int(last[b])] for b in range(B)]
    length = mask.sum(1).cpu()  # tokens in the cache per request
    done = [max_new_tokens <= 1 or out[b][0] in eos for b in range(B)]
    steps, accepted = 0, []
    rows = torch.arange(drafts + 1)
    while not all(done):
        ids = torch.empty(B, drafts + 1, dtype=torch.long)
        ids[:, 0] = torch.tensor([o[-1] for o in out])
        if assistant is None:
            for b in range(B):
                seq = torch.cat([history[b], torch.tensor(out[b])])
                d = prompt_lookup(seq, drafts, max_ngram)
                ids[b, 1:] = out[b][-1]  # a filler draft where lookup finds fewer
                ids[b, 1 : 1 + d.numel()] = d
            ids_d = ids.to(dev)
        else:
            ids_d = _draft(assistant_forward, assistant_cache, ids[:, :1].to(dev), length, drafts)
        pos = length[:, None] + rows
        g = forward(ids_d, position_ids=pos.to(dev), cache=cache).logits.argmax(-1)
        match = (g[:, :drafts] == ids_d[:, 1:]).int().cumprod(1).sum(1)  # accepted drafts
        # what each request keeps: the last token and its accepted drafts, no more than it
        # still needs (so a request never holds more than prompt + max_new_tokens - 1 between
        # steps); a finished request keeps nothing
        need = torch.tensor(
            [0 if d else max_new_tokens - len(o) for d, o in zip(done, out, strict=True)]
        )
        keep = torch.minimum(match + 1, need.to(dev))
        cache.crop((keep - (drafts + 1)).int())
        if assistant is not None:
            assistant_cache.crop((keep - (drafts + 1)).int())
        g, keep, match = g.cpu(), keep.cpu(), match.cpu()
        cache.check()  # a request past its pages raises here (not expected: reserve covers it)
        if assistant is not None:
            assistant_cache.check()
        steps += 1
        times.append(time.perf_counter())
        accepted.append(float(match[~torch.tensor(done)].float().mean()))
        emitted.append([0] * B)
        for b in range(B):
            if done[b]:
                continue
            new = g[b, : int(keep[b])].tolist()
            length[b] += int(keep[b])
            for t in new:
                out[b].append(t)
                emitted[-1][b] += 1
                if len(out[b]) >= max_new_tokens or t in eos:
                    done[b] = True
                    break
    tokens = [torch.tensor(o[:max_new_tokens]) for o in out]
    return Output(tokens, steps, accepted, emitted, times)


def _prompt(model, input_ids, mask, cache, reserve: int) -> torch.Tensor:
    """The prompt's forward (eager, left padding from mask): its last logits [B, 1, V]."""
    cache.reset()
    saved, cache.reserve = cache.reserve, reserve
    try:
        return model(
            input_ids, attention_mask=mask, position_ids=positions(mask), cache=cache,
            logits_to_keep=1,
        ).logits  # fmt: skip
    finally:
        cache.reserve = saved


def _draft(forward, cache, last: torch.Tensor, length: torch.Tensor, drafts: int):
    """[B, 1 + drafts] on the device: the last token, then the assistant's greedy drafts; it
    stores all of them (drafts + 1 forwards of one row)."""
    ids, pos = [last], length[:, None].to(last.device)
    for i in range(drafts + 1):
        logits = forward(ids[-1], position_ids=pos + i, cache=cache).logits
        if i < drafts:
            ids.append(logits[:, -1:].argmax(-1))
    return torch.cat(ids, 1)
