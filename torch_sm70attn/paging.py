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
- `Pager`: a cache's host side over its SlotTable (the transformers adapter's): a step's plan,
  made at layer 0 and reused by the others, the host checks before a prompt stores (its budget,
  left padding), the flags raised once and the refusal until reset, crop counts, and one
  request's pager (a batch of one over its row).
"""

from __future__ import annotations

import copy
import warnings
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



# --- a cache's batch on the host ---------------------------------------------------------------
class Pager:
    """The host side of a paged cache (the transformers adapter's PagedE4M3Cache, whose name its
    errors carry): `num_pages` pages of `page_size` tokens for a batch of at most `max_batch`
    requests, the batch's `SlotTable` (`slot_table`, made by a first step or `start`), the plan
    of the eager step under way (`plan`) and what the host checks: a prompt's budget before it
    stores, the flags (raised once; every step is then refused until `reset`), crop counts, a
    new batch on a used cache. `request(b)` is request b's: a batch of one over views of its
    row, which shares this one's refusal and whose every step is checked."""

    def __init__(self, max_tokens: int, page_size: int, max_batch: int, reserve: int = 0):
        if page_size < 1 or max_tokens < page_size or max_batch < 1 or reserve < 0:
            raise ValueError(
                "PagedE4M3Cache: need page_size >= 1, max_tokens >= page_size, a batch >= 1 "
                "and reserve >= 0"
            )
        self.page_size, self.max_batch = page_size, max_batch
        self.num_pages = -(-max_tokens // page_size)
        self.slot_table: SlotTable | None = None
        # made at a step's layer 0, read by its other layers (an eager step's: a compiled step
        # makes it in each layer, keeping no tensor on self while tracing)
        self.plan: StepPlan | None = None
        self.empty = True  # no step since reset: the next is checked on the host
        self.stale = None  # why every step is refused until reset (an error said so); root's
        self.root = self  # the pager a request(b) view is of (its batch, its refusal)

    def limit(self) -> int:
        """Tokens each request may hold (SlotTable.limit); 0 before the first step."""
        return 0 if self.slot_table is None else self.slot_table.limit

    # -- a step ------------------------------------------------------------------------------
    def step(self, layer: int, layers: int, batch: int, rows: int, valid, position_ids, device,
             reserve: int = 0) -> tuple[StepPlan, int | None]:  # fmt: skip
        """The plan of layer `layer` (of `layers`) of a step of `rows` new tokens for each of
        `batch` requests (valid: bool [B, rows], False for padding, or None; position_ids
        [B or 1, rows], the model's, or None: a request whose first is not its length is
        flagged astray). Layer 0 makes a new batch's table, checks an eager
        prompt on the host (`reserve`: tokens each request adds after it) and advances the
        lengths; an eager step's other layers reuse its plan. Returns (plan, the real tokens of
        a step the host checked, else None)."""
        compiling = torch.compiler.is_compiling()
        tokens = None
        if layer == 0:
            plan, tokens = self._begin(batch, rows, valid, position_ids, device, reserve)
        elif compiling or self.plan is None:
            plan = self.slot_table.plan(rows, valid)
        else:
            plan = self.plan
        if not compiling:
            self.plan = plan if layer < layers - 1 else None
        return plan, tokens

    def _begin(self, B: int, Q: int, valid, position_ids, device, reserve: int):
        """Layer 0: the batch's table (at its first step), the host checks of an eager prompt
        (a prefill chunk, a view's step), each request's length advanced by its real tokens."""
        st = self.slot_table
        if st is None or st.batch != B or st.device != device:
            st = self.allocate(B, device)
        pages, tokens = None, None
        if not torch.compiler.is_compiling():
            if Q > MAX_ROWS or self.empty or self.root is not self:  # one device read
                pages, tokens = self.prompt(Q, valid, reserve)
                pages = pages if Q > MAX_ROWS else None
            self.empty = False
        starts = None
        if position_ids is not None:
            starts = position_ids.reshape(-1, position_ids.shape[-1])[:, 0]
        st.advance(Q, valid, starts)
        return st.plan(Q, valid, pages), tokens

    def allocate(self, B: int, device) -> SlotTable:
        """The table of a batch of B: request b owns pages b * W .. (b + 1) * W - 1."""
        if self.root is not self:
            raise ValueError(
                f"PagedE4M3Cache.request({self.slot_table.first}): a view takes one request on "
                f"{self.slot_table.device}, the forward has {B} on {device}"
            )
        if B > self.max_batch:
            raise ValueError(f"PagedE4M3Cache: batch {B} > max_batch_size {self.max_batch}")
        # a compiled first step cannot check (a data-dependent branch): reset() first
        st = self.slot_table
        if st is not None and not torch.compiler.is_compiling() and self.length():
            raise ValueError(
                f"PagedE4M3Cache holds {st.batch} requests, the forward has {B}: "
                "call cache.reset() before a new batch"
            )
        W = SlotTable.width(self.num_pages, B, self.page_size)
        if W < 1:
            raise ValueError(
                f"PagedE4M3Cache: {self.num_pages} pages for a batch of {B}: raise max_tokens"
            )
        self.slot_table, self.plan = SlotTable(B, W, self.page_size, device), None
        return self.slot_table

    def start(self, batch: int, device) -> bool:
        """The table of `batch` empty requests on `device` before any step; one of the same
        batch and device is kept (it must be empty). Returns whether a table was made."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        st = self.slot_table
        if st is not None and st.batch == batch and st.device == device:
            if self.length():
                raise ValueError("PagedE4M3Cache.start: the cache holds requests: reset() first")
            return False
        self.allocate(batch, device)
        return True

    def prompt(self, Q: int, valid, reserve: int) -> tuple[int, int]:
        """An eager step checked on the host: one device read, then refuse what would not fit
        (`reserve` more tokens after a prompt on empty requests) or is not left padding, before
        anything is stored. Returns (pages in use after the step, the real tokens of the step)."""
        self.check()
        lens = self.slot_table.lens.tolist()
        if valid is None:
            n = [Q] * len(lens)
        else:
            if bool((valid[:, 1:] < valid[:, :-1]).any()):
                raise ValueError(
                    "sm70attn attention: the attention_mask has a zero after a one: only left "
                    "padding (padding_side='left') is supported. generate() derives a mask from "
                    "pad_token_id when none is given, so a prompt containing that token needs "
                    "attention_mask=torch.ones_like(ids)"
                )
            n = valid.sum(1).tolist()
        need = [a + b for a, b in zip(lens, n, strict=True)]
        reserve = reserve if not any(lens) else 0
        if max(need) + reserve > self.limit():
            raise self.over_budget_error(max(need), reserve)
        return -(-max(need) // self.page_size), sum(n)

    def over_budget_error(
        self, need: int, reserve: int = 0, who: str = "a request"
    ) -> RuntimeError:
        """The error for a request of `need` tokens plus `reserve` that its pages (limit())
        cannot hold, with the max_tokens that would (or the kernels' contract)."""
        cap, ps, want = self.limit(), self.page_size, need + reserve
        B = self.root.slot_table.batch  # (a view: its batch's)
        fix = (
            f"the kernels serve at most {contract()} tokens a request"
            if want > contract()
            else f"use max_tokens >= {B * ps * -(-want // ps)}"
        )
        return RuntimeError(
            f"PagedE4M3Cache is full: {who} needs {need} tokens"
            + (f" + reserve {reserve}" if reserve else "")
            + f", each of the {B} requests holds {cap} (max_tokens / batch): {fix}; "
            "nothing was stored"
        )

    # -- lengths and flags -------------------------------------------------------------------
    def length(self) -> int:
        """Tokens held by the longest request (a device read, after `check`); 0 before the
        first step."""
        if self.slot_table is None:
            return 0
        self.check()
        return int(self.slot_table.lens.max())

    def check(self) -> None:
        """Raise if a step went past a request's pages or did not start at its length (reads
        the device)."""
        if self.slot_table is not None and not torch.compiler.is_compiling():
            self.raise_flags(*self.slot_table.flags())

    def poll(self) -> None:
        """Before a step, without waiting for the GPU: refuse it if the cache is stale, raise
        the flags of the copy `SlotTable.poll` started at the previous call."""
        self.refuse_if_stale()
        if self.slot_table is not None:
            self.raise_flags(*self.slot_table.poll())

    def refuse_if_stale(self) -> None:
        """Raise if an earlier error left the cache unusable until reset()."""
        if self.root.stale:
            raise RuntimeError(
                f"PagedE4M3Cache: {self.root.stale} (an earlier error said so), and the cache "
                "still holds it: call cache.reset() before the next prompt"
            )

    def raise_flags(self, full: list[bool], astray: list[bool]) -> None:
        """Raise for the requests flagged (full: past their pages; astray: a step that did not
        start at their length), once: the flags are cleared and the cache is stale."""
        if any(full):
            cap, B = self.limit(), self.root.slot_table.batch
            which = self._stale_now("a request went past its pages in an earlier forward", full)
            raise RuntimeError(
                f"PagedE4M3Cache is full: request(s) {which} went past their {cap} tokens "
                f"(max_tokens={self.num_pages * self.page_size} / batch of {B}); the tokens "
                f"past it were not stored. Use max_tokens >= {B} x (prompt + max_new_tokens + "
                "drafts), rounded up to pages (or reserve=), and cache.reset()"
            )
        if any(astray):
            stale = "a forward's tokens did not start at their requests' lengths"
            which = self._stale_now(stale, astray)
            raise RuntimeError(
                f"PagedE4M3Cache: a forward's tokens did not start at the length of request(s) "
                f"{which}: they do not continue what the cache holds, and were stored after it "
                "(a new prompt on a used cache: generate() feeds the prompt's tokens past the "
                "cache's length, or its last one). A cache that holds tokens continues them, as "
                "transformers' caches do (pass the whole sequence so far); for a new prompt call "
                "cache.reset() first"
            )

    def _stale_now(self, why: str, flagged: list[bool]) -> list[int]:
        """A flag read: the cache is unusable until reset() (`why`), the flags are cleared.
        Returns the flagged requests' indices in the batch."""
        self.root.stale = why
        st = self.slot_table
        st.clear_flags()
        return [st.first + b for b, f in enumerate(flagged) if f]

    def reset(self, stacklevel: int = 2) -> None:
        """Every request empty, the refusal lifted; warns (stacklevel: warnings.warn's, from
        here) if a request went past its pages since the last check (its last tokens were not
        stored)."""
        self.plan, self.empty, self.root.stale = None, True, None
        st = self.slot_table
        if st is not None:
            full = st.full.tolist()
            if any(full):
                warnings.warn(
                    f"PagedE4M3Cache.reset: request(s) "
                    f"{[st.first + b for b, f in enumerate(full) if f]} "
                    f"had gone past their {self.limit()} tokens: the tokens past it were not "
                    "stored and the outputs after that point are wrong; raise max_tokens",
                    stacklevel=stacklevel,
                )
            st.reset()

    def crop(self, tokens_to_remove) -> None:
        """Remove the last tokens of each request: minus the count for every request (an int
        <= 0, transformers' convention), or an integer tensor [B] of minus the count each."""
        st = self.slot_table
        if torch.is_tensor(tokens_to_remove):
            if st is None:
                raise ValueError("PagedE4M3Cache.crop: the cache holds no batch yet")
            n = tokens_to_remove.to(device=st.device, dtype=torch.int32)
            if n.shape != st.lens.shape:
                raise ValueError(
                    f"PagedE4M3Cache.crop: {tuple(n.shape)} counts for {st.batch} requests"
                )
            if not torch.compiler.is_compiling() and bool((n > 0).any()):
                raise ValueError("crop takes minus the number of tokens to remove (<= 0)")
            st.crop(-n)
            return
        if tokens_to_remove > 0:
            raise ValueError("crop takes minus the number of tokens to remove (transformers 5)")
        if tokens_to_remove and st is not None:
            st.crop(-tokens_to_remove)

    def request(self, b: int) -> Pager:
        """Request b's pager: a batch of one over views of its row, length and flags, its every
        step checked on the host, this pager's refusal its own."""
        if self.slot_table is None:
            raise ValueError(
                "PagedE4M3Cache.request: the cache holds no batch yet: run the batch's first "
                "forward, or start(batch, device)"
            )
        B = self.slot_table.batch
        if not 0 <= b < B:
            raise IndexError(f"PagedE4M3Cache.request: request {b} of a batch of {B}")
        view = Pager(self.num_pages * self.page_size, self.page_size, 1)
        view.slot_table, view.root, view.empty = self.slot_table.request(b), self.root, self.empty
        return view
