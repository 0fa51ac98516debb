"""Batched speculative decoding for transformers models on a PagedE4M3Cache: each request of
a batch drafts its own tokens (prompt lookup, or an assistant model), one verify forward
checks B x (drafts + 1) rows, each request accepts its own number of drafts (greedy
acceptance) and the cache crops each request apart (`crop` with a tensor), so the batch stays on the device and in one graph per
width. transformers' own assisted generation takes one request; this is the loop for several.
`serve` is the same loop with continuous batching: any number of requests through the cache's
slots, each joining as a slot frees.

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

from .transformers import (
    PagedE4M3Cache,
    _check_batch,
    _check_vocab,
    _is_ids,
    _vocab,
    positions,
)


@dataclasses.dataclass
class Output:
    tokens: list[torch.Tensor]  # per request, its new tokens (CPU int64)
    steps: int  # verify forwards after the prompt
    accepted: list[float]  # per step, the mean accepted drafts over the running requests
    # per step (serve: per round), the tokens each request emitted (the prompt's first) and
    # the host clock (s) once they were on the host
    emitted: list[list[int]]
    times: list[float]


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
    stores the last draft), so its cache holds what the model's does and both crop alike.
    eos_token_id: the id (or ids) that end a request; None: the model's
    generation_config.eos_token_id, as model.generate stops; [] for none."""
    if max_new_tokens < 1 or drafts < 1:
        raise ValueError("speculative.generate: need max_new_tokens >= 1 and drafts >= 1")
    _check_batch(input_ids, attention_mask, _vocab(model), "speculative.generate")
    _check_cache(cache, "speculative.generate", "cache")
    _check_assistant(model, assistant, "speculative.generate")
    eos = _eos(model, eos_token_id)
    forward = model if forward is None else forward
    B, dev = input_ids.shape[0], input_ids.device
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(dev)
    logits = _prompt(model, input_ids, cache, max_new_tokens + drafts, mask)
    drafter = None  # the assistant's (forward, cache); None: prompt lookup
    if assistant is not None:
        if assistant_cache is None:
            raise ValueError("speculative.generate: an assistant needs its own assistant_cache")
        _check_cache(assistant_cache, "speculative.generate", "assistant_cache")
        _prompt(assistant, input_ids, assistant_cache, max_new_tokens + drafts, mask)
        drafter = (assistant if assistant_forward is None else assistant_forward, assistant_cache)
    last = logits[:, -1].argmax(-1).cpu()
    times, emitted = [time.perf_counter()], [[1] * B]
    history = [input_ids[b][mask[b].bool()].cpu() for b in range(B)]
    out = [[int(last[b])] for b in range(B)]
    length = mask.sum(1).cpu()  # tokens in the cache per request
    done = [max_new_tokens <= 1 or out[b][0] in eos for b in range(B)]
    decoding = _Decoding(forward, cache, drafts, max_new_tokens, eos, max_ngram, dev, drafter)
    steps, accepted = 0, []
    while not all(done):
        running = [None if d else o for d, o in zip(done, out, strict=True)]
        k, finished, mean = decoding.round(running, history, length)
        steps += 1
        times.append(time.perf_counter())
        accepted.append(mean)
        emitted.append(k)
        done = [d or f for d, f in zip(done, finished, strict=True)]
    tokens = [torch.tensor(o[:max_new_tokens]) for o in out]
    return Output(tokens, steps, accepted, emitted, times)


@torch.no_grad()
def serve(
    model,
    prompts: list[torch.Tensor],
    *,
    cache,
    max_new_tokens: int,
    drafts: int = 7,
    forward=None,
    eos_token_id: int | list[int] | None = None,
    max_ngram: int = 3,
    prefill_chunk: int | None = None,
    assistant=None,
    assistant_cache=None,
    assistant_forward=None,
) -> Output:
    """Continuous batching: greedy generation of max_new_tokens for each of `prompts` (1-D id
    tensors of any lengths, any number) through the cache's max_batch_size slots (each
    max_tokens / max_batch_size tokens of pages). A request takes a slot as soon as one is
    free: its prompt runs alone, eager, through cache.request(slot) (emptied first); then it
    joins the verify steps, which always run every slot (1 + drafts rows a slot; the rows of a
    free or joining slot keep nothing), so a compiled `forward` keeps one graph while requests
    come and go, and from one call to the next on the same cache. Every request needs prompt +
    max_new_tokens + drafts tokens of its slot; if one does not fit, the call is refused before
    any forward. Drafts come from prompt lookup, or from `assistant` (a smaller model, as in
    generate(); `assistant_cache` has as many slots, a joining prompt runs through both).

    prefill_chunk: a joining prompt runs this many tokens a round, between the others' verify
    steps (which then do not wait for a whole long prompt), not all at once; a slot whose
    request ends at its first token takes the next request's first chunk in the same round.
    Where a cache's scales are calibrated from the first tokens (the default), the first prompt
    calibrates them whole first (`cache.calibrate`), not its first chunk.

    Output: tokens in the order of `prompts`; emitted and times per round (the prompts that
    joined, then the verify step if a request was running): the tokens each request emitted,
    the host clock at the round's end; accepted per verify step, over the requests running."""
    if max_new_tokens < 1 or drafts < 1:
        raise ValueError("speculative.serve: need max_new_tokens >= 1 and drafts >= 1")
    _check_prompts(prompts, _vocab(model))
    _check_cache(cache, "speculative.serve", "cache")
    _check_assistant(model, assistant, "speculative.serve")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError("speculative.serve: prefill_chunk >= 1 tokens (or None: whole prompts)")
    eos = _eos(model, eos_token_id)
    forward = model if forward is None else forward
    dev, S = model.device, cache.max_batch_size
    pairs, drafter = [(model, cache)], None  # drafter: the assistant's (forward, cache)
    if assistant is not None:
        if assistant_cache is None or assistant_cache.max_batch_size != S:
            raise ValueError(
                f"speculative.serve: an assistant needs its own assistant_cache of {S} slots "
                "(max_batch_size), as many as the cache's"
            )
        _check_cache(assistant_cache, "speculative.serve", "assistant_cache")
        pairs.append((assistant, assistant_cache))
        drafter = (assistant if assistant_forward is None else assistant_forward, assistant_cache)
    _start(pairs, prompts, max_new_tokens + drafts, dev, calibrate=prefill_chunk is not None)
    decoding = _Decoding(forward, cache, drafts, max_new_tokens, eos, max_ngram, dev, drafter)
    requests = [_Request(i, p) for i, p in enumerate(prompts)]
    length = torch.zeros(S, dtype=torch.long)  # tokens in the cache per slot
    slots = _Slots(decoding, pairs, prefill_chunk, requests[::-1], [None] * S, length)
    steps, accepted, emitted, times = 0, [], [], []
    while slots.queue or any(r is not None for r in slots.request):
        emitted.append([0] * len(requests))
        for s in range(S):  # free slots take the next requests; a joining one its next chunk
            slots.admit(s, emitted[-1])
        mean = slots.step(emitted[-1])
        if mean is not None:
            steps += 1
            accepted.append(mean)
        times.append(time.perf_counter())
    return Output([torch.tensor(r.out) for r in requests], steps, accepted, emitted, times)


def _start(pairs, prompts, reserve: int, dev, calibrate: bool) -> None:
    """serve's caches (pairs: the model and its cache, then the assistant and its cache), before
    any forward: emptied, each given the table of its max_batch_size slots (the same as the
    last call's: a compiled step's graph replays), every request checked within its slot's
    pages (prompt + reserve). calibrate (prompts joining in chunks): a cache whose scales come
    from its first tokens calibrates them on the first prompt whole."""
    for _, c in pairs:
        c.reset()
        c.start(c.max_batch_size, dev)
        for i, p in enumerate(prompts):
            if p.numel() + reserve > c.limit():
                raise c.over_budget_error(p.numel(), reserve, who=f"request {i}")
    for m, c in pairs:
        if calibrate and len(prompts) and c.uncalibrated():  # the first prompt, whole
            c.calibrate(m, prompts[0].reshape(1, -1).to(dev))
            c.start(c.max_batch_size, dev)


@dataclasses.dataclass
class _Request:
    """One request of serve: its place in `prompts`, its prompt (1-D ids), the prompt tokens
    stored so far (it runs once all are), the tokens it emitted, and its prompt on the CPU
    (prompt lookup's history) once it runs past its first token."""

    index: int
    prompt: torch.Tensor
    filled: int = 0
    out: list[int] = dataclasses.field(default_factory=list)
    history: torch.Tensor | None = None

    def running(self) -> bool:
        """Its whole prompt is stored: it steps with the others."""
        return self.filled == self.prompt.numel()


@dataclasses.dataclass
class _Slots:
    """serve's scheduler over the cache's slots: the requests not started (`queue`, the next
    last), the request in each slot (None: free) and the tokens each slot holds in the cache.
    A request is admitted to a free slot, its prompt runs there (whole, or a chunk a round),
    it steps with the others in the shared verify round, and retires when it finishes (its
    slot free for the next one)."""

    decoding: _Decoding
    pairs: list  # the (model, cache) pairs a joining prompt runs through: the model's first
    chunk: int | None  # prompt tokens a round (None: whole prompts)
    queue: list[_Request]
    request: list[_Request | None]
    length: torch.Tensor  # CPU [slots]: tokens in the cache per slot

    def admit(self, s: int, emitted: list[int]) -> None:
        """Slot s this round: a free slot takes the next request; a joining request runs its
        prompt (or next chunk) there. A request done at its first token retires at once, and
        the slot takes the next one in the same round."""
        while self.request[s] is not None or self.queue:
            if self.request[s] is None:
                self.request[s] = self.queue.pop()
            r = self.request[s]
            if r.running():
                return
            logits = self.prefill(s, r)
            if not r.running():
                return  # the next chunk next round
            r.out, emitted[r.index] = [int(logits[0, -1].argmax())], 1
            d = self.decoding
            if d.max_new_tokens > 1 and r.out[0] not in d.eos:
                r.history = r.prompt.reshape(-1).cpu()
                return
            self.retire(s)

    def prefill(self, s: int, r: _Request) -> torch.Tensor:
        """The next chunk of r's prompt (all of it without prefill_chunk) through slot s of
        each cache: the model's last logits [1, 1, V]."""
        L, d = r.prompt.numel(), self.decoding
        ids = r.prompt.reshape(1, -1)[:, r.filled : r.filled + (self.chunk or L)].to(d.device)
        reserve = d.max_new_tokens + d.drafts
        logits = [_prompt(m, ids, c.request(s), reserve, start=r.filled) for m, c in self.pairs]
        r.filled += ids.shape[1]
        self.length[s] = r.filled  # (a joining slot's verify rows keep nothing)
        return logits[0]

    def step(self, emitted: list[int]) -> float | None:
        """The verify round over every slot, if a request is running (a free or joining slot's
        rows keep nothing); those that finish retire. Returns the mean accepted drafts over
        the running requests, or None if none ran."""
        running = [r if r is not None and r.running() else None for r in self.request]
        if all(r is None for r in running):
            return None
        out = [None if r is None else r.out for r in running]
        history = [None if r is None else r.history for r in running]
        k, finished, mean = self.decoding.round(out, history, self.length)
        for s, r in enumerate(running):
            if r is not None:
                emitted[r.index] += k[s]
                if finished[s]:
                    self.retire(s)
        return mean

    def retire(self, s: int) -> None:
        """A finished request leaves slot s (its tokens stay in its out); the next request to
        take the slot empties it (its prompt's first chunk resets cache.request(s))."""
        self.request[s] = None


@dataclasses.dataclass
class _Decoding:
    """The decoding round generate and serve both run (`round`), and what it runs with: the
    verify forward and its cache, the drafts (prompt lookup, or an assistant's forward and
    cache), when a request stops."""

    forward: object
    cache: object
    drafts: int
    max_new_tokens: int
    eos: set
    max_ngram: int
    device: torch.device
    drafter: tuple | None  # the assistant's (forward, cache); None: prompt lookup

    def round(self, running, history, length):
        """One round over the rows of the cache's batch. running[b]: the tokens emitted so far
        by the request in row b (appended to here), or None (finished, or a free or joining
        slot: its rows keep nothing); history[b]: its prompt (CPU); length: CPU [B] tokens in
        the cache per row, advanced here. Drafts for each row, one verify forward, each row's
        accepted drafts kept (the assistant's cache cropped as the model's). Returns the
        tokens each row emitted, whether its request finished (max_new_tokens or eos), and the
        mean accepted drafts over the running rows."""
        if self.drafter is None:
            ids_d = _lookup(running, history, self.drafts, self.max_ngram).to(self.device)
        else:
            last = torch.tensor([o[-1] if o else 0 for o in running])[:, None].to(self.device)
            ids_d = _draft(*self.drafter, last, length, self.drafts)
        # each request still needs max_new_tokens - len(out): one not running keeps nothing
        need = [0 if o is None else self.max_new_tokens - len(o) for o in running]
        g, keep, match = _verify(self.forward, self.cache, ids_d, length, need)
        if self.drafter is not None:
            self.drafter[1].crop((keep - (self.drafts + 1)).int().to(self.device))
            self.drafter[1].check()
        mean = float(match[torch.tensor([o is not None for o in running])].float().mean())
        emitted, finished = [0] * len(running), [False] * len(running)
        for b, o in enumerate(running):
            if o is not None:
                length[b] += int(keep[b])
                emitted[b], finished[b] = _emit(
                    o, g[b, : int(keep[b])], self.max_new_tokens, self.eos
                )
        return emitted, finished, mean


def _eos(model, eos_token_id) -> set:
    """The ids that end a request: eos_token_id (an id or a list of ids; [] for none), or where
    it is None the model's generation_config.eos_token_id, as model.generate takes it."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set() if eos_token_id is None else set(torch.tensor(eos_token_id).reshape(-1).tolist())


def _check_prompts(prompts, vocab: int | None) -> None:
    """serve's prompts: a list (or tuple) of 1-D integer tensors of ids in [0, vocab), each one
    request's real tokens. A 2-D tensor is refused: its rows may hold padding, which would be
    taken for prompt tokens."""
    want = "a list of 1-D integer tensors, one a request (its real tokens, any length)"
    if torch.is_tensor(prompts):
        raise TypeError(
            f"speculative.serve: prompts are {want}, not a {prompts.dim()}-D tensor: for a batch "
            "whose rows hold no padding pass list(ids.unbind(0)); for a padded one, each row's "
            "real tokens (ids[b][mask[b].bool()])"
        )
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"speculative.serve: prompts are {want}, not {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not torch.is_tensor(p):
            raise TypeError(
                f"speculative.serve: prompt {i} is a {type(p).__name__}; prompts are {want} "
                "(torch.tensor(ids) of a list of ids)"
            )
        if p.dim() != 1 or not _is_ids(p):
            raise TypeError(
                f"speculative.serve: prompt {i} is a {p.dim()}-D {p.dtype} tensor; prompts are {want}"
            )
        if p.numel() == 0:
            raise ValueError(f"speculative.serve: prompt {i} holds no tokens")
        _check_vocab(p, vocab, f"speculative.serve: prompt {i}")


def _check_cache(cache, who: str, name: str) -> None:
    """The loops store through a PagedE4M3Cache (its slots, reserve and crop by request)."""
    if not isinstance(cache, PagedE4M3Cache):
        raise TypeError(
            f"{who}: {name} is {type(cache).__name__ if cache is not None else 'None'}; pass an "
            "empty torch_sm70attn.integrations.transformers.PagedE4M3Cache(model.config, "
            "max_tokens=..., max_batch_size=...) with room for every request"
        )


def _check_assistant(model, assistant, who: str) -> None:
    """An assistant drafts ids the model reads and reads ids the model emits: one vocabulary."""
    if assistant is not None and _vocab(assistant) != _vocab(model):
        raise ValueError(
            f"{who}: the assistant's vocab_size is {_vocab(assistant)}, the model's "
            f"{_vocab(model)}: drafts are token ids, so the assistant needs the model's "
            "vocabulary (the same tokenizer and embedding size)"
        )


def _emit(out: list[int], new: torch.Tensor, max_new_tokens: int, eos: set) -> tuple[int, bool]:
    """Append a request's kept tokens to its out, up to max_new_tokens or an eos token;
    returns (tokens appended, finished)."""
    for k, t in enumerate(new.tolist()):
        out.append(t)
        if len(out) >= max_new_tokens or t in eos:
            return k + 1, True
    return new.numel(), False


def _lookup(out, history, drafts: int, max_ngram: int) -> torch.Tensor:
    """[B, 1 + drafts] (CPU): each request's last token and its prompt-lookup drafts (the last
    token again where lookup finds fewer); a request whose out is None (finished, or a free
    slot) gets zeros."""
    ids = torch.zeros(len(out), drafts + 1, dtype=torch.long)
    for b, o in enumerate(out):
        if o is None:
            continue
        d = prompt_lookup(torch.cat([history[b], torch.tensor(o)]), drafts, max_ngram)
        ids[b] = o[-1]
        ids[b, 1 : 1 + d.numel()] = d
    return ids


def _verify(forward, cache, ids_d, length, need):
    """One verify forward of B x (1 + drafts) rows at positions length (CPU [B]): the greedy
    token after each row, the drafts each request accepts (up to the first mismatch) and what
    it keeps: the last token and its accepted drafts, no more than it still needs (`need`
    [B]; so a request never holds more than prompt + max_new_tokens - 1 between steps). The
    cache keeps those tokens of each request (crop); returns (greedy, keep, accepted), CPU."""
    rows, dev = ids_d.shape[1], ids_d.device
    pos = (length[:, None] + torch.arange(rows)).to(dev)
    g = forward(ids_d, position_ids=pos, cache=cache).logits.argmax(-1)
    match = (g[:, : rows - 1] == ids_d[:, 1:]).int().cumprod(1).sum(1)  # accepted drafts
    keep = torch.minimum(match + 1, torch.tensor(need, device=dev))
    cache.crop((keep - rows).int())
    g, keep, match = g.cpu(), keep.cpu(), match.cpu()
    cache.check()  # a request past its pages raises here (not expected: the reserve covers it)
    return g, keep, match


def _prompt(model, ids, cache, reserve: int, mask=None, start: int = 0) -> torch.Tensor:
    """Prompt tokens start .. start + len through `cache` (eager; emptied at start 0, where the
    reserve is checked too): the last logits [B, 1, V]. mask: left padding (generate's batch),
    else every token; positions count the real tokens from `start`."""
    if start == 0:
        cache.reset()
    mask = torch.ones_like(ids) if mask is None else mask
    saved, cache.reserve = cache.reserve, reserve
    try:
        return model(
            ids, attention_mask=mask, position_ids=positions(mask) + start, cache=cache,
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
