"""Hugging Face transformers: a paged E4M3 KV cache and the attention that reads it.

    from torch_sm70attn.integrations.transformers import PagedE4M3Cache, register

    register()  # attn_implementation="sm70attn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sm70attn", dtype=torch.float16)
    cache = PagedE4M3Cache(model.config, max_tokens=8192)
    out = model.generate(ids, past_key_values=cache, prompt_lookup_num_tokens=4, do_sample=False)

No modeling code changes. The model calls `cache.update(key, value, layer_idx, kwargs=kwargs)`
with the same dict it then hands the attention function as `**kwargs`: `update` writes the
new tokens with `store_kv` and puts the layer's caches, block table and lengths into that
dict under "sm70attn". The attention function then serves up to 16 query rows (decode, and
verification of speculative drafts) with `paged_attention`, and longer queries (a prompt, a
chunked prefill) with SDPA over the dequantized pages; both apply the op's rule: row r of a
request of length L sees positions 0 .. L - Q + r. The new tokens are read back from the cache
like every other token, so a prompt, a verify step and a decode step see the same numbers,
and speculative decoding with greedy acceptance emits exactly the greedy tokens.

Requests of one batch may have different lengths in the cache, but padding tokens inside a
forward (left padding from a tokenizer) are refused: they would be written and attended.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

import torch_sm70attn as sa
from torch_sm70attn.manifest import MANIFEST

NAME = "sm70attn"  # no "flash" in it: transformers would look for a flash-attention package
FP8 = torch.float8_e4m3fn
MAX_ROWS = MANIFEST.query_rows[-1]  # more query rows take the prefill route
HEADROOM = 2.0  # calibrated scale = amax / 448 * HEADROOM: later tokens may be larger


def register(name: str = NAME) -> str:
    """Register the attention and its mask function under `name` (idempotent)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _mask)
    return name


# --- the cache ---------------------------------------------------------------------------------
class _Layer(CacheLayerMixin):
    """One layer's pools; lengths and tables live in the PagedE4M3Cache."""

    is_croppable = True

    def __init__(self, cache: PagedE4M3Cache):
        super().__init__()
        self.cache = cache
        self.k_scale = self.v_scale = None

    def lazy_initialization(self, key_states, value_states):
        c = self.cache
        shape = (c.num_pages, c.page_size, c.num_kv_heads, c.head_dim)
        self.keys = torch.zeros(shape, dtype=FP8, device=key_states.device)
        self.values = torch.zeros(shape, dtype=FP8, device=key_states.device)
        self.k_scale = _scale(c.k_scale, key_states, c.num_kv_heads)
        self.v_scale = _scale(c.v_scale, value_states, c.num_kv_heads)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("PagedE4M3Cache.update writes the layers")

    def get_mask_sizes(self, query_length):
        return self.cache.get_seq_length() + query_length, 0

    def get_seq_length(self):
        return self.cache.get_seq_length()

    def get_max_length(self):
        return self.cache.get_max_length()

    def reset(self):  # the pools stay allocated; the cache frees the pages
        pass


def _scale(given, x: torch.Tensor, heads: int) -> torch.Tensor:
    """float32 [H_kv] scale: given (float or tensor of 1 or H_kv), or amax per head of the
    first tokens written (x [B, H_kv, T, D]) / 448, with headroom."""
    if given is not None:
        s = torch.as_tensor(given, dtype=torch.float32, device=x.device).reshape(-1)
        if s.numel() not in (1, heads):
            raise ValueError(f"PagedE4M3Cache: a scale must have 1 or H_kv={heads} values")
        return s.expand(heads).contiguous()
    amax = x.detach().abs().float().amax(dim=(0, 2, 3))
    return torch.where(amax > 0, amax / 448.0 * HEADROOM, 1.0).contiguous()


class PagedE4M3Cache(Cache):
    """A paged float8_e4m3fn KV cache for transformers models.

    config: the model's config (layers, KV heads, head dim). max_tokens: the token budget
    shared by all requests of the batch (pages of every layer: max_tokens / page_size).
    max_batch_size: requests per batch. k_scale / v_scale: a float, or a per-KV-head list or
    tensor, applied to every layer; None calibrates each layer's scales per KV head from the
    first tokens it stores (amax / 448, with 2x headroom; larger values saturate at 448).
    """

    def __init__(
        self,
        config,
        max_tokens: int = 4096,
        max_batch_size: int = 1,
        page_size: int = 16,
        k_scale=None,
        v_scale=None,
    ):
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if page_size < 1 or max_tokens < page_size or max_batch_size < 1:
            raise ValueError(
                "PagedE4M3Cache: need page_size >= 1, max_tokens >= page_size, a batch >= 1"
            )
        self.page_size, self.max_batch_size = page_size, max_batch_size
        self.num_pages = math.ceil(max_tokens / page_size)
        self.k_scale, self.v_scale = k_scale, v_scale
        super().__init__(layers=[_Layer(self) for _ in range(cfg.num_hidden_layers)])
        self.reset()

    # request state: host copies (no device sync to read them) and their device mirrors
    def reset(self):
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._pages: list[list[int]] = []
        self._lens: list[int] = []
        self._table = None  # device [B, pages] int32, written only where a page is added
        self._step = None  # (slots, block_table, seq_lens, fresh) of the forward in progress

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self._lens, default=0)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.num_pages * self.page_size

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove tokens of every request (rejected drafts).
        Their pages stay with the request and are written over by the next tokens."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes minus the number of tokens to remove (transformers 5)")
        self._lens = [max(0, n + tokens_to_remove) for n in self._lens]

    def _begin(self, B: int, Q: int, device) -> None:
        """Pages and slots for Q new tokens of each of B requests (at layer 0)."""
        if not self._lens:
            if B > self.max_batch_size:
                raise ValueError(
                    f"PagedE4M3Cache: batch {B} > max_batch_size {self.max_batch_size}"
                )
            self._pages, self._lens = [[] for _ in range(B)], [0] * B
        if B != len(self._lens):
            raise ValueError(
                f"PagedE4M3Cache holds {len(self._lens)} requests, the forward has {B}"
            )
        if self._table is None or self._table.device != torch.device(device):
            self._table = torch.zeros(B, self.num_pages, dtype=torch.int32, device=device)
        ps, slots, added = self.page_size, [], []
        fresh = not any(self._lens)  # a prompt: every request holds just these Q tokens
        for b in range(B):
            start, end = self._lens[b], self._lens[b] + Q
            while len(self._pages[b]) * ps < end:
                if not self._free:
                    raise RuntimeError(
                        f"PagedE4M3Cache is full ({self.num_pages} pages of {ps} tokens): "
                        "raise max_tokens"
                    )
                added.append((b, len(self._pages[b]), self._free[-1]))
                self._pages[b].append(self._free.pop())
            slots += [self._pages[b][t // ps] * ps + t % ps for t in range(start, end)]
            self._lens[b] = end
        if added:  # one small copy per page added, not the whole table per step
            b, i, page = torch.tensor(added, dtype=torch.int64).T.to(device)
            self._table[b, i] = page.int()
        width = max(len(p) for p in self._pages)
        self._step = (
            torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            self._table[:, :width],
            torch.tensor(self._lens, dtype=torch.int32).to(device, non_blocking=True),
            fresh,
        )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store the new tokens ([B, H_kv, Q, D]) and hand the attention its paged inputs
        through the model's kwargs; returns the new tokens (the attention reads the cache)."""
        B, H, Q, D = key_states.shape
        if layer_idx == 0:
            self._begin(B, Q, key_states.device)
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        slots, table, lens, fresh = self._step
        sa.store_kv(
            key_states.transpose(1, 2).reshape(B * Q, H, D).half(),
            value_states.transpose(1, 2).reshape(B * Q, H, D).half(),
            layer.keys,
            layer.values,
            slots,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
        )
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise TypeError(
                "PagedE4M3Cache: the model did not pass its attention kwargs to cache.update("
                "..., kwargs=...), so the sm70attn attention cannot find the paged cache"
            )
        attn_kwargs[NAME] = (
            layer.keys,
            layer.values,
            table,
            lens,
            layer.k_scale,
            layer.v_scale,
            fresh,
        )
        return key_states, value_states


# --- the attention -----------------------------------------------------------------------------
def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention: query [B, H_q, Q, D]; returns ([B, Q, H_q, D], None)."""
    if dropout:
        raise ValueError("sm70attn attention: dropout is not supported (use model.eval())")
    paged = kwargs.get(NAME)
    if paged is None:
        # Another cache (DynamicCache): key/value hold every position; the same rule.
        B, Q, T = query.shape[0], query.shape[2], key.shape[2]
        lens = torch.full((B,), T, dtype=torch.int32, device=query.device)
        mask = sa.verifier_mask(lens, Q, T)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    kc, vc, table, lens, ks, vs, fresh = paged
    if query.dtype != torch.float16:
        raise TypeError(
            f"sm70attn attention needs a float16 model, got {query.dtype}: load it with "
            "dtype=torch.float16"
        )
    if query.shape[2] <= MAX_ROWS:
        out = sa.paged_attention(query, kc, vc, table, lens, scale=scaling, k_scale=ks, v_scale=vs)
    else:
        out = _prefill(query, kc, vc, table, lens, scaling, ks, vs, fresh)
    return out.transpose(1, 2), None


def _prefill(query, kc, vc, table, lens, scale, ks, vs, fresh=False):
    """More than 16 query rows: SDPA over the request's pages, dequantized (FP32 on the CPU,
    where half-precision SDPA is slow and rounds more), with the op's visibility rule. A fresh
    prompt (every request holds just these Q tokens) is plain causal attention over its first
    Q positions; otherwise (a chunked prefill) the rule is a [B, 1, Q, capacity] mask."""
    B, H_q, Q, D = query.shape
    H = kc.shape[2]
    dt = query.dtype if query.is_cuda else torch.float32
    k = kc[table].flatten(1, 2).to(dt) * ks.view(1, 1, H, 1).to(dt)
    v = vc[table].flatten(1, 2).to(dt) * vs.view(1, 1, H, 1).to(dt)
    if fresh:
        k, v, mask = k[:, :Q], v[:, :Q], None
    else:
        mask = sa.verifier_mask(lens, Q, k.shape[1])
    out = F.scaled_dot_product_attention(
        query.to(dt),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=fresh,
        scale=scale,
        enable_gqa=True,
    )
    return out.to(query.dtype)


def _mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """The mask function of NAME: none is built (the attention applies the op's rule); a
    padded batch is refused, since its padding tokens would be stored and attended."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "sm70attn attention: the batch has padding (attention_mask holds zeros); padding "
            "tokens would be written to the cache and attended. Generate each request alone "
            "(batch 1), or batch requests of equal length"
        )
    return None
