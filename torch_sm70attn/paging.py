"""The paging core under both engine adapters (transformers' cache, vLLM's backend): a step
reduced to its plan (per-request lengths, query rows, slots, block table) and the attention
over the pages that plan names.

The rule is the op's for every route: row r of a request of length L (counting its new tokens,
already stored) sees positions 0 .. L - Q + r, each read back from the pages as
float(e4m3) x scale, so a prompt, a chunked prefill, a verify step and a decode step see the
same stored numbers, never the unrounded float16 K/V.

- `attend`: the queries of one step, [B, H_q, Q, D]: up to MAX_ROWS rows through the fused op
  (`sa.paged_attention`), more (a prompt, a prefill chunk) through `prefill`.
- `prefill`: the same rows packed for `sa.paged_attention_varlen`, which reads the pages where
  they are; `dequantized`: pages as float16 (what the engines did before it, and tests do).
- `attend_packed`: a step as vLLM packs it ([T, H_q, D] with query_start_loc), one op call.
- `ragged_rows` / `unragged`: a step of requests of different query lengths, packed as vLLM packs
  them ([T, H, D] with query_start_loc), as [B, H, Q, D] with each request's rows last (the op's
  rule then holds for every real row; the rows before them see fewer positions and are
  dropped), and back.
- `contiguous_slots`: the slots of a request whose pages are consecutive (the transformers
  cache's table), for the rows a step stores.
- `SlotTable`: such a table on the device with each request's length and flags; a step's
  `advance` and `plan` (a `StepPlan`: what every layer's attention reads), crop, beam reorder
  and one request's view, each in place and without a host read (a CUDA graph replays them).
- Scales: `per_layer_scales` (checked on the host once), `device_scale`, `calibrated_scale`
  (amax / 448 per KV head) and `Saturation` (values stored beyond 448 x scale, counted).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

import torch_sm70attn as sa
from torch_sm70attn.manifest import MANIFEST, admitted_capacity, contract

MAX_ROWS = MANIFEST.query_rows[-1]  # more query rows take the prefill route
E4M3_MAX = 448.0


def attend(query, kc, vc, table, lens, scale, ks, vs, *, pages=None):
    """The attention of one step: query [B, H_q, Q, D] float16 over the pages (key/value cache
    [P, page_size, H_kv, D] float8_e4m3fn, table [B, W] int32, lens [B] int32 counting the new
    tokens). pages: the table width in use (a prompt's pages), where known: a narrower table
    plans fewer splits. Returns [B, H_q, Q, D]."""
    if query.shape[2] <= MAX_ROWS:
        return sa.paged_attention(query, kc, vc, table, lens, scale=scale, k_scale=ks, v_scale=vs)
    return prefill(query, kc, vc, table if pages is None else table[:, :pages], lens, scale, ks, vs)


def prefill(query, kc, vc, table, lens, scale, ks, vs):
    """More than MAX_ROWS query rows a request (a prompt, a chunk over a past): the B requests'
    rows packed one after another into one `sa.paged_attention_varlen` call, which reads the
    E4M3 pages where they are (no dequantized copy of the past). The rule is the op's: a row
    that sees nothing (left padding of a prompt) is 0."""
    B, H_q, Q, D = query.shape
    qsl = torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32, device=query.device)
    packed = query.transpose(1, 2).reshape(B * Q, H_q, D)
    out = sa.paged_attention_varlen(
        packed, kc, vc, table, qsl, lens, scale=scale, k_scale=ks, v_scale=vs
    )
    return out.view(B, Q, H_q, D).transpose(1, 2)


def attend_packed(query, kc, vc, table, qsl, lens, scale, ks, vs, *, rows=None, uniform=False,
                  tokens=None):  # fmt: skip
    """A step as an engine packs it (vLLM): query [T, H_q, D], request b's tokens
    query[qsl[b]:qsl[b + 1]] (query_start_loc [B + 1], on the device), lens [B] counting them,
    table [B, W]. One op call: `sa.paged_attention_varlen` over the tokens as they lie (rows
    None: any mix of prompts, chunks, decodes and verifies; returns [T, H_q, D], 0 from qsl[B]
    on), or where every request has at most `rows` <= MAX_ROWS of them (a decode and verify
    step, `tokens` in all) `sa.paged_attention`, each request's rows placed last in a
    [B, H_q, rows, D] query (`ragged_rows`; uniform: each has exactly `rows`, but for padding
    requests of none after them, so the tokens are [B, rows] as they lie); returns the first
    `tokens` rows [tokens, H_q, D]."""
    if rows is None:
        return sa.paged_attention_varlen(
            query, kc, vc, table, qsl, lens, scale=scale, k_scale=ks, v_scale=vs
        )
    B, (_, H, D) = table.shape[0], query.shape
    if not rows:
        return query.new_zeros(0, H, D)
    if uniform:
        q = query[:tokens].view(B, rows, H, D).transpose(1, 2)
    else:
        q = query[ragged_rows(qsl, B, rows)].transpose(1, 2)
    o = sa.paged_attention(q, kc, vc, table, lens, scale=scale, k_scale=ks, v_scale=vs)
    if uniform:
        return o.transpose(1, 2).reshape(tokens, H, D)
    return unragged(o, token_rows(qsl, B, rows, tokens))


def dequantized(cache, table, scale, dtype) -> torch.Tensor:
    """The pages of `table` [B, W] as [B, W * page_size, H_kv, D] in dtype, times scale
    (a float32 tensor of 1 or H_kv values)."""
    H = cache.shape[2]
    return cache[table].flatten(1, 2).to(dtype) * scale.reshape(-1).expand(H).view(1, 1, H, 1).to(
        dtype
    )


def ragged_rows(query_start_loc: torch.Tensor, num_reqs: int, rows: int) -> torch.Tensor:
    """[num_reqs, rows] int64: the packed token index of row r of each request, its query's
    rows placed last (request b's last token at row rows - 1); rows before a request's first
    token repeat earlier tokens (clamped at 0), whose outputs `unragged` drops. From the device
    tensor query_start_loc [>= num_reqs + 1] with no host read (a CUDA graph replays it)."""
    ends = query_start_loc[1 : num_reqs + 1].long()
    r = torch.arange(rows, device=ends.device)
    return (ends[:, None] - rows + r).clamp_(min=0)


def token_rows(query_start_loc: torch.Tensor, num_reqs: int, rows: int, num_tokens: int):
    """For each packed token t < num_tokens: (request, row) in `ragged_rows`' layout."""
    ends = query_start_loc[1 : num_reqs + 1].long()
    t = torch.arange(num_tokens, device=ends.device)
    b = torch.searchsorted(ends, t, right=True).clamp_(max=num_reqs - 1)
    return b, (t - ends[b] + rows).clamp_(0, rows - 1)


def unragged(out: torch.Tensor, where) -> torch.Tensor:
    """out [B, H, rows, D] back to packed tokens [T, H, D]; where: `token_rows`."""
    b, r = where
    return out.transpose(1, 2)[b, r]


def contiguous_slots(
    table, lens, rows: int, page_size: int, skip=None, offsets=None
) -> torch.Tensor:
    """Slots [B * rows] of the last `rows` tokens of each request (lens counts them), where a
    request's pages are consecutive from table[b, 0]: position p is slot first * page_size + p.
    skip: bool [B, rows] or [B, 1], True where nothing is stored (slot -1). offsets: the
    table's `contiguous_offsets` for these rows, where kept from an earlier step."""
    offsets = contiguous_offsets(table, rows, page_size) if offsets is None else offsets
    slots = lens[:, None].long() + offsets
    return (slots if skip is None else slots.masked_fill(skip, -1)).flatten()


def contiguous_offsets(table, rows: int, page_size: int) -> torch.Tensor:
    """[B, rows] int64: the slot of row r of each request less its length (`contiguous_slots`):
    first page x page_size - rows + r."""
    first = table[:, :1].long() * page_size
    return first - rows + torch.arange(rows, device=table.device)


def static_address(*tensors) -> None:
    """Tell torch.compile these tensors keep their address (CUDA graphs read them in place).
    Unguarded: a new cache of the same shapes reuses the compiled graph (CUDA graphs are
    recorded again for its addresses)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t, guard=False)


# --- the slot table --------------------------------------------------------------------------
class StepPlan(NamedTuple):
    """What a layer's attention reads of one step, the same for every layer of a forward."""

    table: torch.Tensor  # [B, W] int32
    lens: torch.Tensor  # [B] int32, counting this step's tokens
    slots: torch.Tensor  # [B * rows] int64: where each new token is stored, -1 for none
    rows: int  # query rows a request (Q)
    pages: int | None  # the pages in use (the prefill route's table width), where known
    valid: torch.Tensor | None  # bool [B, rows], False for padding; None: every row is real


class SlotTable:
    """The block table of a batch on the device, each request owning `width` consecutive pages
    (request b: pages b x width .. (b + 1) x width - 1), with each request's length (int32
    [B]) and two flags (bool [B]): `full`, a step would have taken it past `limit` tokens (it
    stopped there and stores nothing more), and `astray`, a step's first token was not at its
    length. Every step changes these tensors in place (a CUDA graph reads them where they are)
    and reads nothing from the host, so that it traces into one graph."""

    def __init__(self, batch: int, width: int, page_size: int, device):
        self.page_size = page_size
        self.first = 0  # the first request's index in the table this one views (`request`)
        self.table = torch.arange(batch * width, dtype=torch.int32, device=device).view(
            batch, width
        )
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.full = torch.zeros(batch, dtype=torch.bool, device=device)
        self.astray = torch.zeros(batch, dtype=torch.bool, device=device)
        self._offsets = {}  # rows -> contiguous_offsets, made once outside a compiled graph
        self._host = None  # pinned [2, B] bool: the flags' copy `poll` reads
        static_address(self.table, self.lens, self.full, self.astray)

    @staticmethod
    def width(num_pages: int, batch: int, page_size: int) -> int:
        """Pages per request of a batch sharing num_pages: an equal share, within the capacity
        the kernels admit (every decode and verify step passes the whole table)."""
        return min(num_pages // batch, admitted_capacity(page_size) // page_size)

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def capacity(self) -> int:
        """Tokens each request's pages hold."""
        return self.table.shape[1] * self.page_size

    @property
    def limit(self) -> int:
        """Tokens each request may hold: its pages, within the kernels' contract (a table may
        address part of a page more)."""
        return min(self.capacity, contract())

    def advance(self, rows: int, valid=None, starts=None) -> None:
        """A step's first layer: each request's length grows by its real new tokens (valid:
        bool [B, rows], False for padding; None: all `rows`). A request they would take past
        `limit` stops there and is flagged full. starts: [B] the position of each request's
        first new token, where known: a request whose start is not its length is flagged
        astray."""
        if starts is not None:
            self.astray.logical_or_(starts.to(self.lens.dtype) != self.lens)
        self.lens.add_(rows if valid is None else valid.sum(1, dtype=torch.int32))
        over = self.lens > self.limit
        self.lens.clamp_(max=self.limit)
        self.full.logical_or_(over)

    def slots(self, rows: int, valid=None) -> torch.Tensor:
        """The slots [B * rows] of the new tokens, after `advance`: -1 for padding and for a
        full request."""
        skip = self.full[:, None] if valid is None else self.full[:, None] | ~valid
        return contiguous_slots(
            self.table, self.lens, rows, self.page_size, skip, self.offsets(rows)
        )

    def offsets(self, rows: int) -> torch.Tensor:
        """`contiguous_offsets` of this table: made once per rows outside a compiled graph (a
        step there makes its own, keeping nothing)."""
        compiling = torch.compiler.is_compiling()
        off = None if compiling else self._offsets.get(rows)
        if off is None:
            off = contiguous_offsets(self.table, rows, self.page_size)
            if not compiling:
                self._offsets[rows] = off
        return off

    def plan(self, rows: int, valid=None, pages=None) -> StepPlan:
        """The step's plan, after `advance` (pages: see StepPlan)."""
        return StepPlan(self.table, self.lens, self.slots(rows, valid), rows, pages, valid)

    def crop(self, n) -> None:
        """Remove the last n tokens of each request (an int for all, or an int tensor [B]); the
        next step writes over them."""
        self.lens.sub_(n).clamp_(min=0)

    def reorder(self, beam_idx: torch.Tensor, pools) -> None:
        """Beam search: request i continues request beam_idx[i]: its pages in use in each of
        `pools` ([P, page_size, ...]) get a copy of that request's (copies, since two requests
        may continue one), and its length and flags become that request's."""
        beam_idx = beam_idx.to(self.device)
        pages = -(-int(self.lens.max()) // self.page_size)
        src, dst = self.table[beam_idx, :pages].long(), self.table[:, :pages].long()
        for pool in pools:
            pool = pool.view(torch.uint8)
            pool[dst] = pool[src]
        for t in (self.lens, self.full, self.astray):
            t.copy_(t[beam_idx])

    def request(self, b: int) -> SlotTable:
        """Request b alone: a table of one over views of its row, length and flags (a step
        through it changes them here)."""
        view = copy.copy(self)
        view.table, view.lens, view.full, view.astray = (
            t[b : b + 1] for t in (self.table, self.lens, self.full, self.astray)
        )
        view.first, view._offsets, view._host = self.first + b, {}, None
        static_address(view.table, view.lens, view.full, view.astray)
        return view

    def reset(self) -> None:
        """Every request empty, its flags cleared."""
        self.lens.zero_()
        self.clear_flags()

    def flags(self) -> tuple[list[bool], list[bool]]:
        """(full, astray) per request: a device read."""
        return self.full.tolist(), self.astray.tolist()

    def poll(self) -> tuple[list[bool], list[bool]]:
        """The flags without waiting for the GPU: those of the copy started at the previous
        poll (complete once the host has synchronized since), then the next copy started. On
        the CPU, `flags()`."""
        if not self.full.is_cuda:
            return self.flags()
        if self._host is None:
            self._host = torch.zeros((2, self.batch), dtype=torch.bool, pin_memory=True)
        full, astray = self._host.tolist()
        self._host[0].copy_(self.full, non_blocking=True)
        self._host[1].copy_(self.astray, non_blocking=True)
        return full, astray

    def clear_flags(self) -> None:
        self.full.zero_()
        self.astray.zero_()
        if self._host is not None:  # no copy of the old flags may land after this
            torch.cuda.current_stream(self.device).synchronize()
            self._host.zero_()


# --- scales ------------------------------------------------------------------------------------
def per_layer_scales(given, layers: int, what: str) -> list:
    """None or one scale (a float, or a tensor of 1 or H_kv values) for every layer, or a list
    or tuple of one such per layer: one per layer, each checked here, on the host, once (a
    first forward, which may be compiled, only shapes them: `device_scale`). what: the
    argument's name, for the errors."""
    if isinstance(given, (list, tuple)):
        if len(given) != layers:
            raise ValueError(
                f"{what} is a list of {len(given)}; a list holds one scale per layer "
                f"({layers}); give one scale for every layer as a float or a tensor of 1 or "
                "H_kv values"
            )
        out = list(given)
    else:
        out = [given] * layers
    for s in out:
        if s is not None:
            v = torch.as_tensor(s, dtype=torch.float32).reshape(-1).cpu()
            if not bool((v > 0).all() & v.isfinite().all()):
                raise ValueError(f"{what} must be finite and > 0, got {v.tolist()}")
    return out


def device_scale(given, heads: int, device) -> torch.Tensor:
    """A checked scale (`per_layer_scales`) as float32 [heads] on the device: no data is read,
    so a compiled first forward traces it without a graph break."""
    s = torch.as_tensor(given, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() not in (1, heads):
        raise ValueError(f"a scale must have 1 or H_kv={heads} values")
    return s.expand(heads).contiguous()


def calibrated_scale(x: torch.Tensor, valid, headroom: float) -> torch.Tensor:
    """float32 [H]: amax per KV head of x [B, H, Q, D] over the real tokens (valid: bool [B, Q]
    or None) / 448, times headroom; 1 for a head of zeros."""
    a = x.detach().abs().float()
    if valid is not None:
        a = a * valid[:, None, :, None]
    amax = a.amax(dim=(0, 2, 3))
    return torch.where(amax > 0, amax / E4M3_MAX * headroom, 1.0).contiguous()


class Saturation:
    """K and V values stored beyond 448 x scale (saturated to +-448), and the values counted:
    a forward starts (`start`), adds each layer's on the device (`add`) and reads them once,
    at its last layer (`read`)."""

    def __init__(self):
        self.saturated = [0, 0]  # K and V values saturated, of
        self.counted = 0  # this many values each
        self.warned = False  # `read` said so once
        self._forward: list[torch.Tensor] = []  # the forward's counts, on the device
        self._tokens = 0  # the forward's real tokens

    def start(self, tokens: int) -> None:
        """A forward of this many real new tokens a layer (what one that raised left is
        dropped)."""
        self._forward.clear()
        self._tokens = tokens

    def add(self, key, value, k_scale, v_scale, valid=None) -> None:
        """One layer's new tokens (key, value [B, H, Q, D]; valid: bool [B, Q], False for
        padding, or None) stored at these scales ([H])."""
        for x, s in ((key, k_scale), (value, v_scale)):
            over = x.abs() > (E4M3_MAX * s).to(x.dtype).view(1, -1, 1, 1)
            if valid is not None:
                over &= valid[:, None, :, None]
            self._forward.append(over.sum())
        self.counted += key.shape[1] * key.shape[3] * self._tokens

    def read(self) -> bool:
        """Add the forward's counts (one device read). Returns whether values have saturated
        and this is the first time it says so."""
        got = torch.stack(self._forward).view(-1, 2).sum(0).tolist()
        self._forward.clear()
        self.saturated = [a + b for a, b in zip(self.saturated, got, strict=True)]
        news = any(self.saturated) and not self.warned
        self.warned |= news
        return news

    def fractions(self) -> list[float]:
        """The fraction of the K and of the V values counted that saturated."""
        return [n / max(self.counted, 1) for n in self.saturated]
