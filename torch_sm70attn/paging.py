"""The paging core under both engine adapters (transformers' cache, vLLM's backend): a step
reduced to its plan (per-request lengths, query rows, slots, block table) and the attention
over the pages that plan names.

The rule is the op's for every route: row r of a request of length L (counting its new tokens,
already stored) sees positions 0 .. L - Q + r, each read back from the pages as
float(e4m3) x scale, so a prompt, a chunked prefill, a verify step and a decode step see the
same stored numbers, never the unrounded float16 K/V.

- `attend`: the queries of one step, [B, H_q, Q, D]: up to MAX_ROWS rows through the fused op
  (`sa.paged_attention`), more (a prompt, a prefill chunk) through `prefill`.
- `prefill`: SDPA over the dequantized pages with the op's rule.
- `ragged_rows` / `unragged`: a step of requests of different query lengths, packed as vLLM packs
  them ([T, H, D] with query_start_loc), as [B, H, Q, D] with each request's rows last (the op's
  rule then holds for every real row; the rows before them see fewer positions and are
  dropped), and back.
- `contiguous_slots`: the slots of a request whose pages are consecutive (the transformers
  cache's table), for the rows a step stores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_sm70attn as sa
from torch_sm70attn.manifest import MANIFEST

MAX_ROWS = MANIFEST.query_rows[-1]  # more query rows take the prefill route
E4M3_MAX = 448.0


def attend(query, kc, vc, table, lens, scale, ks, vs, *, pages=None, fresh=False):
    """The attention of one step: query [B, H_q, Q, D] float16 over the pages (key/value cache
    [P, page_size, H_kv, D] float8_e4m3fn, table [B, W] int32, lens [B] int32 counting the new
    tokens). pages: the prefill route's table width (the pages in use), where known; fresh: every
    request holds just these Q tokens (plain causal attention). Returns [B, H_q, Q, D]."""
    if query.shape[2] <= MAX_ROWS:
        return sa.paged_attention(query, kc, vc, table, lens, scale=scale, k_scale=ks, v_scale=vs)
    table = table if pages is None else table[:, :pages]
    return prefill(query, kc, vc, table, lens, scale, ks, vs, fresh)


def dequantized(cache, table, scale, dtype) -> torch.Tensor:
    """The pages of `table` [B, W] as [B, W * page_size, H_kv, D] in dtype, times scale
    (a float32 tensor of 1 or H_kv values)."""
    H = cache.shape[2]
    return cache[table].flatten(1, 2).to(dtype) * scale.reshape(-1).expand(H).view(1, 1, H, 1).to(
        dtype
    )


def prefill(query, kc, vc, table, lens, scale, ks, vs, fresh=False):
    """More than MAX_ROWS query rows: SDPA over the requests' pages, dequantized (FP32 on the
    CPU, where half-precision SDPA is slow and rounds more), with the op's visibility rule. A
    fresh prompt (every request holds just these Q tokens) is plain causal attention over its
    first Q positions; otherwise (padding, a chunked prefill) the rule is a [B, 1, Q, W x
    page_size] mask, and a row that sees nothing (left padding of a prompt) outputs 0, as in
    the op. On a GPU the KV heads are repeated for each query head (SDPA's memory-efficient
    kernel takes a mask but not grouped heads)."""
    B, H_q, Q, D = query.shape
    dt = query.dtype if query.is_cuda else torch.float32
    k, v = dequantized(kc, table, ks, dt), dequantized(vc, table, vs, dt)
    if fresh:
        k, v, mask = k[:, :Q], v[:, :Q], None
    else:
        mask = sa.verifier_mask(lens, Q, k.shape[1])
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    gqa = not query.is_cuda
    if query.is_cuda and H_q != k.shape[1]:
        k = k.repeat_interleave(H_q // k.shape[1], dim=1)
        v = v.repeat_interleave(H_q // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(
        query.to(dt), k, v, attn_mask=mask, is_causal=fresh, scale=scale, enable_gqa=gqa
    )
    if mask is not None:
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0)
    return out.to(query.dtype)


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


def contiguous_slots(table, lens, rows: int, page_size: int, skip=None) -> torch.Tensor:
    """Slots [B * rows] of the last `rows` tokens of each request (lens counts them), where a
    request's pages are consecutive from table[b, 0]: position p is slot first * page_size + p.
    skip: bool [B, rows] or [B, 1], True where nothing is stored (slot -1)."""
    first = table[:, :1].long() * page_size
    slots = first + lens[:, None].long() - rows + torch.arange(rows, device=table.device)
    return (slots if skip is None else slots.masked_fill(skip, -1)).flatten()
