"""Independent oracles for the tests: FP64 attention over a paged cache and an exact E4M3
encoder, written from the format's definition rather than from torch's conversions.
"""

from __future__ import annotations

import numpy as np
import torch


def e4m3_table() -> np.ndarray:
    """float64 value of every E4M3FN byte (bias 7, no infinities, 0x7F/0xFF NaN)."""
    vals = np.empty(256)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
        if e == 0xF and m == 7:
            v = np.nan
        elif e == 0:
            v = m / 8 * 2.0**-6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        vals[b] = -v if s else v
    return vals


_TABLE = e4m3_table()
_POS = _TABLE[:0x7F]  # codes 0x00..0x7E: the non-negative finite values, increasing


def decode_e4m3(t: torch.Tensor) -> torch.Tensor:
    """float64 values of a float8_e4m3fn tensor, by table lookup (not torch's conversion),
    on the tensor's device."""
    table = torch.from_numpy(_TABLE).to(t.device)
    return table[t.contiguous().view(torch.uint8).long()]


def encode_e4m3(x32: np.ndarray) -> np.ndarray:
    """Bytes of float32 values: saturate to +-448, round to nearest, ties to the even code."""
    x = x32.astype(np.float64)  # exact: every float32 and every midpoint below is exact
    sign = np.signbit(x).astype(np.uint8) << 7
    a = np.abs(x)
    hi = np.searchsorted(_POS, a, side="left").clip(1, 0x7E)  # _POS[hi-1] < a <= _POS[hi]
    lo = hi - 1
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= 448.0, 0x7E, code)
    code = np.where(a == 0, 0, code)
    code = np.where(np.isnan(x), 0x7F, code)
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def attention_fp64(
    query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale, *, clamp=False
):
    """FP64 paged attention, one request and KV head at a time with a full (not online)
    softmax, on the inputs' device; returns float64 [B, H_q, Q, D] on the CPU.

    clamp=True gives the CUDA path's answer for invalid inputs: lengths clamped to
    [0, capacity], positions on pages outside [0, P) contribute nothing."""
    B, H_q, Q, D = query.shape
    P, page_size, H_kv, _ = key_cache.shape
    capacity = block_table.shape[1] * page_size
    G = H_q // H_kv
    dev = query.device
    ks = k_scale.to(dev, torch.float64).reshape(-1).expand(H_kv)
    vs = v_scale.to(dev, torch.float64).reshape(-1).expand(H_kv)
    out = torch.zeros(B, H_q, Q, D, dtype=torch.float64, device=dev)
    for b, L in enumerate(seq_lens.cpu().tolist()):
        if clamp:
            L = min(max(L, 0), capacity)
        if L <= 0:
            continue
        t = torch.arange(L, device=dev)
        pages = block_table[b].long()[t // page_size]
        good = (pages >= 0) & (pages < P)
        pages = pages.clamp(0, P - 1)
        k = decode_e4m3(key_cache[pages, t % page_size]) * ks[None, :, None]  # [L, H_kv, D]
        v = decode_e4m3(value_cache[pages, t % page_size]) * vs[None, :, None]
        visible = t[None, :] <= (L - Q + torch.arange(Q, device=dev))[:, None]  # [Q, L]
        if clamp:
            visible &= good[None, :]
        for kv in range(H_kv):
            q = query[b, kv * G : (kv + 1) * G].double()  # [G, Q, D]
            s = (q @ k[:, kv].T) * scale  # [G, Q, L]
            s = s.masked_fill(~visible, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see nothing: 0
            out[b, kv * G : (kv + 1) * G] = p @ v[:, kv]
    return out.cpu()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in FP64; NaN anywhere gives inf (NaN never passes)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    den = ref.norm().item()
    return (out - ref).norm().item() / den if den > 0 else (out - ref).norm().item()


def varlen_attention_fp64(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale,
    v_scale, *, clamp=False,
):  # fmt: skip
    """FP64 paged_attention_varlen: request b's rows as attention_fp64's rows of a request of
    Q = its row count (clamp: as there); rows from query_start_loc[B] on are 0. float64
    [T, H_q, D], CPU."""
    T, H_q, D = query.shape
    out = torch.zeros(T, H_q, D, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for b in range(seq_lens.shape[0]):
        s, e = qsl[b], qsl[b + 1]
        if e > s:
            q = query[s:e].transpose(0, 1)[None]
            o = attention_fp64(
                q, key_cache, value_cache, block_table[b : b + 1], seq_lens[b : b + 1], scale,
                k_scale, v_scale, clamp=clamp,
            )  # fmt: skip
            out[s:e] = o[0].transpose(0, 1)
    return out
