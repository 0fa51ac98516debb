"""Reference kernels in plain PyTorch: the CPU implementation of the ops and the fallback
route on a GPU. They define the numbers the CUDA kernels are measured against.

Inputs are assumed checked (see checks.py). They run on any device; on a GPU they read
seq_lens on the host, so the reference route is not CUDA-graph capturable.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Context positions per step of the online softmax: bounds memory at 256K contexts
# (the K and V chunks in FP32 are CHUNK x H_kv x D x 4 bytes each).
CHUNK = 4096


def _per_head(scale: torch.Tensor, h_kv: int) -> torch.Tensor:
    return scale.reshape(-1).float().expand(h_kv)


def paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale):
    B, H_q, Q, D = query.shape
    P, page_size, H_kv, _ = key_cache.shape
    G = H_q // H_kv
    capacity = block_table.shape[1] * page_size
    ks = _per_head(k_scale, H_kv)[:, None, None]
    vs = _per_head(v_scale, H_kv)[None, :, None]
    out = torch.zeros(B, H_q, Q, D, dtype=torch.float16, device=query.device)
    rows = torch.arange(Q, device=query.device).repeat(G)  # row index r of each (g, r) row
    for b, L in enumerate(seq_lens.tolist()):
        L = min(max(L, 0), capacity)
        last = L - Q + rows  # last visible position of each row; < 0 sees nothing
        if L == 0 or last.numel() == 0 or last.max() < 0:  # (no rows: Q = 0 or H_q = 0)
            continue
        # [H_q, Q, D] -> [H_kv, G*Q, D]: query head h = kv * G + g reads KV head kv.
        q = query[b].float().reshape(H_kv, G * Q, D) * scale
        m = torch.full((H_kv, G * Q), float("-inf"), device=query.device)
        l = torch.zeros(H_kv, G * Q, device=query.device)
        acc = torch.zeros(H_kv, G * Q, D, device=query.device)
        for start in range(0, L, CHUNK):
            t = torch.arange(start, min(L, start + CHUNK), device=query.device)
            page = block_table[b, t // page_size].long()
            off = t % page_size
            k = key_cache[page, off].float().transpose(0, 1) * ks  # [H_kv, n, D]
            v = value_cache[page, off].float() * vs  # [n, H_kv, D]
            s = torch.bmm(q, k.transpose(1, 2))  # [H_kv, G*Q, n]
            s = s.masked_fill(t[None, None, :] > last[None, :, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.bmm(p, v.transpose(0, 1))
            m = m_new
        # a row that saw no key (m = -inf) is 0; NaN from the inputs (l or acc NaN) stays NaN
        o = torch.where(m[..., None] == float("-inf"), 0.0, acc / l[..., None])
        out[b] = o.reshape(H_q, Q, D).to(torch.float16)
    return out


# Query rows per reference call of paged_attention_varlen: bounds the scores' memory for long
# prompts (ROW_BLOCK x G x CHUNK floats per KV head).
ROW_BLOCK = 256


def paged_attention_varlen(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale, v_scale
):
    """Request b's rows query[qsl[b]:qsl[b+1]] (q rows) are paged_attention's rows of a request
    of Q = q: row i sees t <= seq_lens[b] - q + i. Rows from qsl[B] on are 0. Row blocks of
    ROW_BLOCK go through paged_attention with their own length (the rule shifts with the block),
    counted back from the request's last row: a left-padded request's real rows fall in the
    blocks they take alone (a block's key count sets how its sums round)."""
    T, H_q, D = query.shape
    out = torch.zeros(T, H_q, D, dtype=torch.float16, device=query.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, L in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        for i1 in range(e, s, -ROW_BLOCK):
            i0 = max(s, i1 - ROW_BLOCK)
            q = query[i0:i1].transpose(0, 1)[None]  # [1, H_q, rows, D]
            L_blk = L - (e - i1)  # the block's last row is the request's row i1 - 1 - s
            o = paged_attention(
                q, key_cache, value_cache, block_table[b : b + 1],
                torch.tensor([L_blk], dtype=torch.int32), scale, k_scale, v_scale,
            )  # fmt: skip
            out[i0:i1] = o[0].transpose(0, 1)
    return out


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in FP32, saturated to +-448, rounded to nearest even; NaN stays NaN.

    `scale` broadcasts over the head dim of x [..., H_kv, D] (shape [], [1] or [H_kv]).
    """
    h_kv = x.shape[-2]
    s = _per_head(scale, h_kv)[:, None]
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    page_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page, off = slots // page_size, slots % page_size
    key_cache[page, off] = quantize_e4m3(key[keep], k_scale)
    value_cache[page, off] = quantize_e4m3(value[keep], v_scale)


def verifier_mask(seq_lens, q_rows: int, kv_len: int) -> torch.Tensor:
    """[B, 1, Q, kv_len] bool: row r of request b sees t <= seq_lens[b] - Q + r."""
    dev = seq_lens.device
    last = seq_lens.long()[:, None] - q_rows + torch.arange(q_rows, device=dev)[None, :]
    t = torch.arange(kv_len, device=dev)
    return (t[None, None, :] <= last[:, :, None]).unsqueeze(1).contiguous()
