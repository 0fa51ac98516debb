"""Input checks shared by the CPU reference kernels and the fake kernels.

Cheap checks look only at metadata (dtype, rank, device, shapes, strides) and run on every
call, fake tensors included. Value checks read seq_lens and the block table; they always run
on the CPU path, and on CUDA only in validate mode (they synchronise the stream).
Errors name the argument and what was expected: TypeError for a dtype, ValueError otherwise.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def _dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def _same_device(ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but query is on {ref.device}")


def _last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.size(-1) > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _scale(name: str, t: torch.Tensor, h_kv: int) -> None:
    _dtype(name, t, torch.float32)
    if t.dim() > 1 or t.numel() not in (1, h_kv):
        raise ValueError(f"{name} must have shape [], [1] or [H_kv={h_kv}], got {tuple(t.shape)}")


def check_paged_attention(query, key_cache, value_cache, block_table, seq_lens, k_scale, v_scale):
    """Metadata checks of sm70attn::paged_attention; returns (B, H_q, Q, D, P, page, H_kv)."""
    _dtype("query", query, torch.float16)
    _dtype("key_cache", key_cache, FP8)
    _dtype("value_cache", value_cache, FP8)
    _dtype("block_table", block_table, torch.int32)
    _dtype("seq_lens", seq_lens, torch.int32)
    _rank("query", query, 4, "[B, H_q, Q, D]")
    _rank("key_cache", key_cache, 4, "[P, page_size, H_kv, D]")
    _rank("block_table", block_table, 2, "[B, max_pages]")
    _rank("seq_lens", seq_lens, 1, "[B]")
    _same_device(
        query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        _last_dim_contiguous(name, t)
    _last_dim_contiguous("block_table", block_table)
    B, H_q, Q, D = query.shape
    P, page_size, H_kv, D_kv = key_cache.shape
    if D_kv != D:
        raise ValueError(f"query head dim {D} != key_cache head dim {D_kv}")
    if H_kv == 0 or H_q % H_kv != 0:
        msg = f"query heads H_q={H_q} must be a multiple of cache heads H_kv={H_kv}"
        if H_kv and Q and Q % H_kv == 0:  # looks like [B, Q, H_q, D]: heads in dim 2
            msg += (
                f"; query must be [B, H_q, Q, D] (SDPA layout), got {tuple(query.shape)}: "
                "if it is [B, Q, H_q, D], pass query.transpose(1, 2)"
            )
        raise ValueError(msg)
    if page_size == 0:
        raise ValueError("key_cache page_size (dim 1) must be >= 1")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, query batch is {B}")
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, query batch is {B}")
    _scale("k_scale", k_scale, H_kv)
    _scale("v_scale", v_scale, H_kv)
    return B, H_q, Q, D, P, page_size, H_kv


def check_paged_attention_values(block_table, seq_lens, num_pages, page_size):
    """Value checks (reads the tensors: synchronises when they live on a GPU)."""
    capacity = block_table.shape[1] * page_size
    lens = seq_lens.to("cpu", torch.int64)
    if lens.numel() and (lens.min() < 0 or lens.max() > capacity):
        bad = lens[(lens < 0) | (lens > capacity)][0].item()
        raise ValueError(
            f"seq_lens must lie in [0, capacity={capacity}] "
            f"(block_table width {block_table.shape[1]} x page_size {page_size}), got {bad}"
        )
    # Only pages a request reaches are checked: tables are commonly padded with -1 or junk.
    pages_used = (lens + page_size - 1) // page_size
    used = torch.arange(block_table.shape[1])[None, :] < pages_used[:, None]
    ids = block_table.to("cpu")[used]
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_pages):
        bad = ids[(ids < 0) | (ids >= num_pages)][0].item()
        raise ValueError(f"block_table page ids must lie in [0, {num_pages}), got {bad}")


def check_paged_attention_varlen(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale, v_scale
):
    """Metadata checks of sm70attn::paged_attention_varlen; returns (T, H_q, D, B, P, page, H_kv)."""
    _dtype("query", query, torch.float16)
    _rank("query", query, 3, "[T, H_q, D] (the requests' tokens, packed)")
    _dtype("query_start_loc", query_start_loc, torch.int32)
    _rank("query_start_loc", query_start_loc, 1, "[B + 1]")
    _dtype("seq_lens", seq_lens, torch.int32)
    _rank("seq_lens", seq_lens, 1, "[B]")
    _same_device(query, query_start_loc=query_start_loc)
    B = seq_lens.shape[0]
    if query_start_loc.shape[0] != B + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries, seq_lens has {B}: "
            "query_start_loc must be [B + 1] (request b's rows are query[qsl[b]:qsl[b + 1]])"
        )
    T, H_q, D = query.shape
    # The rest as paged_attention's, through a [B, H_q, 1, D] stand-in for the query.
    shaped = query.new_empty((B, H_q, 1, D))
    _, _, _, _, P, page_size, H_kv = check_paged_attention(
        shaped, key_cache, value_cache, block_table, seq_lens, k_scale, v_scale
    )
    _last_dim_contiguous("query", query)
    return T, H_q, D, seq_lens.shape[0], P, page_size, H_kv


def check_query_start_loc_values(query_start_loc, T):
    """query_start_loc [B + 1]: 0 first, non-decreasing, at most T (reads it)."""
    qsl = query_start_loc.to("cpu", torch.int64)
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {qsl[0].item()}")
    steps = qsl[1:] - qsl[:-1]
    if steps.numel() and steps.min() < 0:
        b = int((steps < 0).nonzero()[0])
        raise ValueError(
            f"query_start_loc must be non-decreasing, got query_start_loc[{b}] = "
            f"{qsl[b].item()} > query_start_loc[{b + 1}] = {qsl[b + 1].item()}"
        )
    if qsl[-1] > T:
        raise ValueError(
            f"query_start_loc[B] = {qsl[-1].item()} exceeds the query's T = {T} tokens"
        )


def check_store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    """Metadata checks of sm70attn::store_kv; returns (T, H_kv, D, P, page_size)."""
    _dtype("key", key, torch.float16)
    _dtype("value", value, torch.float16)
    _dtype("key_cache", key_cache, FP8)
    _dtype("value_cache", value_cache, FP8)
    _dtype("slot_mapping", slot_mapping, torch.int64)
    _rank("key", key, 3, "[T, H_kv, D]")
    _rank("key_cache", key_cache, 4, "[P, page_size, H_kv, D]")
    _rank("slot_mapping", slot_mapping, 1, "[T]")
    _same_device(
        key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        _last_dim_contiguous(name, t)
    T, H_kv, D = key.shape
    P, page_size, H_c, D_c = key_cache.shape
    if (H_c, D_c) != (H_kv, D):
        raise ValueError(
            f"key is [T, H_kv={H_kv}, D={D}] but key_cache is [P, page, H_kv={H_c}, D={D_c}]"
        )
    if slot_mapping.shape[0] != T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, key has T={T}")
    _scale("k_scale", k_scale, H_kv)
    _scale("v_scale", v_scale, H_kv)
    return T, H_kv, D, P, page_size


def check_store_kv_values(slot_mapping, num_slots):
    s = slot_mapping.to("cpu")
    bad = s[(s < -1) | (s >= num_slots)]
    if bad.numel():
        raise ValueError(
            f"slot_mapping entries must be -1 or lie in [0, {num_slots}), got {bad[0].item()}"
        )


def check_verifier_mask(seq_lens, q_rows, kv_len):
    _dtype("seq_lens", seq_lens, torch.int32)
    _rank("seq_lens", seq_lens, 1, "[B]")
    if q_rows < 1:
        raise ValueError(f"q_rows must be >= 1, got {q_rows}")
    if kv_len < 0:
        raise ValueError(f"kv_len must be >= 0, got {kv_len}")
