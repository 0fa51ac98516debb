"""torch_sm70attn: fused paged-FP8-KV attention for V100 (SM70) GPUs, as torch ops.

    out = torch_sm70attn.paged_attention(query, key_cache, value_cache, block_table, seq_lens)

See README.md for the semantics and DESIGN notes, `python -m torch_sm70attn info` for what
this machine supports.
"""

from __future__ import annotations

import functools
import numbers
from pathlib import Path

import torch

from . import ops, routes  # ops registers the sm70attn:: operators
from .manifest import MANIFEST, contract
from .routes import CUDA, REFERENCE, UNSUPPORTED, Admission, admit

__version__ = "0.1.0"
__all__ = [
    "paged_attention",
    "paged_attention_varlen",
    "store_kv",
    "verifier_mask",
    "capabilities",
    "admit",
    "contract",
    "Admission",
    "CUDA",
    "REFERENCE",
    "UNSUPPORTED",
    "model_path",
]


def model_path() -> Path:
    """The folder of the small model that ships with the package: a Qwen3-architecture causal
    LM with the seeds' attention geometry (head dim 256, 6 query heads per KV head, 2 KV heads),
    trained on Python source (tools/train_lm.py; docs/quality.md). transformers loads it
    offline: AutoModelForCausalLM.from_pretrained(model_path()), and likewise AutoTokenizer."""
    return Path(__file__).parent / "model"


@functools.lru_cache(maxsize=64)
def _scale_tensor(value: float, device: torch.device) -> torch.Tensor:
    # Cached so that a float scale costs no host-to-device copy per call (and none during
    # CUDA-graph capture once it has been seen outside it).
    return torch.tensor(float(value), dtype=torch.float32, device=device)


_REAL = (float, int, numbers.Real)  # float first: the common case skips the ABC check
_EXPECTED = {
    "query": "float16 [B, H_q, Q, D]",
    "key_cache": "float8_e4m3fn [P, page_size, H_kv, D]",
    "value_cache": "float8_e4m3fn [P, page_size, H_kv, D]",
    "block_table": "int32 [B, max_pages]",
    "seq_lens": "int32 [B]",
    "query_start_loc": "int32 [B + 1]",
    "key": "float16 [T, H_kv, D]",
    "value": "float16 [T, H_kv, D]",
    "slot_mapping": "int64 [T]",
}


def _not_a_tensor(**args) -> TypeError:
    """The error for the first of `args` that is not a tensor (called only on failure, so
    that the hot path pays for one isinstance per argument and nothing else)."""
    name, x = next((n, x) for n, x in args.items() if not isinstance(x, torch.Tensor))
    return TypeError(f"{name} must be a torch.Tensor ({_EXPECTED[name]}), got {type(x).__name__}")


def _as_scale(name: str, x, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, _REAL):
        raise TypeError(
            f"{name} must be a float or a float32 tensor of shape [], [1] or [H_kv], "
            f"got {type(x).__name__}"
        )
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        # Traced (Dynamo warns on lru_cache; torch.tensor would copy from the host, which a
        # CUDA graph cannot capture: a fill kernel instead), or under a dispatch mode
        # (FakeTensorMode, make_fx, torch.export's non-strict tracing): a cached real tensor
        # must not enter the mode, nor a fake one made under it be cached for later calls.
        return torch.full((), float(x), dtype=torch.float32, device=device)
    return _scale_tensor(float(x), device)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Attention of `query` [B, H_q, Q, D] fp16 over a paged float8_e4m3fn KV cache.

    key_cache, value_cache: [P, page_size, H_kv, D]; block_table: [B, max_pages] int32;
    seq_lens: [B] int32, KV tokens per request including the Q new ones. Row r of request
    b attends to positions [0, seq_lens[b] - Q + r]; a row that sees nothing outputs 0.
    K and V are float(e4m3) * k_scale / v_scale (float, or float32 tensor [], [1], [H_kv]).
    scale defaults to D ** -0.5. Returns [B, H_q, Q, D] float16.
    """
    T = torch.Tensor
    if not (
        isinstance(query, T)
        and isinstance(key_cache, T)
        and isinstance(value_cache, T)
        and isinstance(block_table, T)
        and isinstance(seq_lens, T)
    ):
        raise _not_a_tensor(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=block_table,
            seq_lens=seq_lens,
        )
    if scale is None:
        scale = query.shape[-1] ** -0.5
    args = (
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        float(scale),
        _as_scale("k_scale", k_scale, query.device),
        _as_scale("v_scale", v_scale, query.device),
    )
    # The route is the binding's to decide, as for the raw op's calls (routes.py), except that
    # TORCH_SM70ATTN_DISABLE is read here on every call.
    if query.device.type == "cuda" and routes.disabled():
        return ops.paged_attention_ref(*args)
    return torch.ops.sm70attn.paged_attention.default(*args)


def paged_attention_varlen(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Attention of packed requests over the paged float8_e4m3fn KV cache: any mix of whole
    prompts, chunks over a past, decodes and verifies in one call.

    query [T, H_q, D] float16: request b's rows are query[qsl[b]:qsl[b + 1]] (query_start_loc
    [B + 1] int32, 0 first, non-decreasing, qsl[B] <= T). seq_lens [B] int32 counts request b's
    tokens in the cache including its q = qsl[b + 1] - qsl[b] new ones; its row i attends to
    positions [0, seq_lens[b] - q + i]. A row that sees nothing, and every row from qsl[B] on,
    is 0. The caches, block_table and scales are paged_attention's. Returns [T, H_q, D] float16.
    """
    T = torch.Tensor
    tensors = (query, key_cache, value_cache, block_table, query_start_loc, seq_lens)
    if not isinstance(query, T):
        raise TypeError(
            f"query must be a torch.Tensor (float16 [T, H_q, D]), got {type(query).__name__}"
        )
    if not all(isinstance(t, T) for t in tensors):
        raise _not_a_tensor(
            query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
            query_start_loc=query_start_loc, seq_lens=seq_lens,
        )  # fmt: skip
    if scale is None:
        scale = query.shape[-1] ** -0.5
    args = (
        *tensors,
        float(scale),
        _as_scale("k_scale", k_scale, query.device),
        _as_scale("v_scale", v_scale, query.device),
    )
    if query.device.type == "cuda" and routes.disabled():
        return ops._paged_attention_varlen_ref(*args)
    return torch.ops.sm70attn.paged_attention_varlen.default(*args)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Quantize key/value [T, H_kv, D] fp16 into the caches at slot_mapping [T] int64.

    slot = page * page_size + offset; -1 skips the token. Stored value is
    e4m3(x / scale): FP32 division, saturated to +-448, rounded to nearest even.
    """
    T = torch.Tensor
    if not (
        isinstance(key, T)
        and isinstance(value, T)
        and isinstance(key_cache, T)
        and isinstance(value_cache, T)
        and isinstance(slot_mapping, T)
    ):
        raise _not_a_tensor(
            key=key,
            value=value,
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slot_mapping,
        )
    torch.ops.sm70attn.store_kv.default(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        _as_scale("k_scale", k_scale, key.device),
        _as_scale("v_scale", v_scale, key.device),
    )


def verifier_mask(seq_lens: torch.Tensor, q_rows: int, kv_len: int) -> torch.Tensor:
    """Bool [B, 1, q_rows, kv_len]: True where row r of request b may see position t."""
    return torch.ops.sm70attn.verifier_mask.default(seq_lens, q_rows, kv_len)


def capabilities() -> dict:
    """The capability manifest: what the fused kernels are qualified for."""
    return MANIFEST.as_dict()
