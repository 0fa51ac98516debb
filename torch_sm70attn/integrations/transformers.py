"""Hugging Face transformers: a paged E4M3 KV cache and the attention that reads it.

    from torch_sm70attn.integrations.transformers import PagedE4M3Cache, register

    register()  # attn_implementation="sm70attn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sm70attn", dtype=torch.float16)
    cache = PagedE4M3Cache(model.config, max_tokens=8192)
    out = model.generate(ids, cache=cache, prompt_lookup_num_tokens=4, do_sample=False)

No modeling code changes. The model calls `cache.update(key, value, layer_idx, kwargs=kwargs)`
with the same dict it then hands the attention function as `**kwargs`: `update` writes the
new tokens with `store_kv` and puts the layer's caches, block table and lengths into that
dict under "sm70attn". The attention function then serves up to 16 query rows (decode, and
verification of speculative drafts) with `paged_attention`, and longer queries (a prompt, a
chunked prefill) with SDPA over the dequantized pages; both apply the op's rule: row r of a
request of length L sees positions 0 .. L - Q + r. The new tokens are read back from the cache
like every other token, so a prompt, a verify step and a decode step see the same numbers,
and speculative decoding with greedy acceptance emits exactly the greedy tokens.

The requests of a batch advance together (generate's batches); padding tokens inside a
forward (left padding from a tokenizer) are refused: they would be written and attended.
A forward keeps its state on the device, so `generate(..., compile_config=...)` and
`torch.compile(model, fullgraph=True)` trace a decode or verify step without a graph break.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

import torch_sm70attn as sa
from torch_sm70attn.manifest import MANIFEST, admitted_capacity

NAME = "sm70attn"  # no "flash" in it: transformers would look for a flash-attention package
FP8 = torch.float8_e4m3fn
MAX_ROWS = MANIFEST.query_rows[-1]  # more query rows take the prefill route
HEADROOM = 2.0  # calibrated scale = amax / 448 * HEADROOM: later tokens may be larger


def register(name: str = NAME) -> str:
    """Register the attention and its mask function under `name` (idempotent)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _mask)
    return name


def compile_config(**kw):
    """transformers' CompileConfig for generate() through the sm70attn backend: fullgraph,
    mode "reduce-overhead" (CUDA graphs: inductor's where Triton runs, the backend's own
    recorder on a V100); `kw` overrides. Without one, generate() compiles the decode steps of a
    compileable cache on any GPU with inductor, which cannot target a V100."""
    from transformers import CompileConfig

    return CompileConfig(**{"fullgraph": True, "backend": NAME, "mode": "reduce-overhead", **kw})


# --- the cache ---------------------------------------------------------------------------------
class _Layer(CacheLayerMixin):
    """One layer's pools and scales; the table and lengths live in the PagedE4M3Cache."""

    is_compileable = True
    is_croppable = True

    def __init__(self, cache: PagedE4M3Cache):
        super().__init__()
        self.cache = cache
        self.k_scale = self.v_scale = None

    def lazy_initialization(self, key_states, value_states):
        """Pools sized from the first tokens' heads and head dim (under tensor parallelism, the
        rank's own KV heads)."""
        c, (_, H, _, D) = self.cache, key_states.shape
        shape = (c.num_pages, c.page_size, H, D)
        self.keys = torch.zeros(shape, dtype=FP8, device=key_states.device)
        self.values = torch.zeros(shape, dtype=FP8, device=key_states.device)
        self.k_scale = _scale(c.k_scale, key_states, H)
        self.v_scale = _scale(c.v_scale, value_states, H)
        _static(self.keys, self.values, self.k_scale, self.v_scale)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("PagedE4M3Cache.update writes the layers")

    def get_mask_sizes(self, query_length):
        return self.cache.get_mask_sizes(query_length)

    def get_seq_length(self):
        return self.cache.get_seq_length()

    def get_max_length(self):
        return self.cache.get_max_length()

    def reset(self):  # the pools stay allocated; the cache resets the lengths
        pass


def _static(*tensors) -> None:
    """Tell torch.compile these tensors keep their address (CUDA graphs read them in place).
    Unguarded: a new cache of the same shapes reuses the compiled graph (CUDA graphs are
    recorded again for its addresses)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t, guard=False)


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
    """A paged float8_e4m3fn KV cache for transformers models, usable under torch.compile
    and CUDA graphs (`is_compileable`).

    config: the model's config (its layer count). max_tokens: the token budget of the batch;
    every layer has max_tokens / page_size pages of [page_size, H_kv, D], H_kv and D taken
    from the first tokens stored (under tensor parallelism, the rank's own KV heads).
    max_batch_size: the largest batch. The first forward (the prompt) of a batch of B requests
    gives each request max_tokens / B tokens of pages. k_scale / v_scale: a float, or a
    per-KV-head list or tensor, applied to every layer; None calibrates each layer's scales
    per KV head from the first tokens it stores (amax / 448, with 2x headroom; larger values
    saturate at 448).

    State on the device: the block table (fixed once the batch is known) and the lengths
    [B] int32, advanced in place by each forward and moved back by `crop`; a forward reads
    nothing from the host, so a compiled decode or verify step has no graph break and replays
    as a CUDA graph. The host keeps a copy of the length between eager steps (no device sync
    to read it); after compiled steps `get_seq_length()` reads it back once. An eager forward
    past a request's pages raises; a compiled one cannot check, and indexing past the table
    stops the GPU with a device-side assert: size max_tokens for the prompt, the new tokens
    and the drafts of every request.
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
        if page_size < 1 or max_tokens < page_size or max_batch_size < 1:
            raise ValueError(
                "PagedE4M3Cache: need page_size >= 1, max_tokens >= page_size, a batch >= 1"
            )
        self.page_size, self._max_batch = page_size, max_batch_size
        self.num_pages = math.ceil(max_tokens / page_size)
        self.k_scale, self.v_scale = k_scale, v_scale
        super().__init__(layers=[_Layer(self) for _ in range(cfg.num_hidden_layers)])
        self._table = self._lens = None  # device [B, pages] int32 and [B] int32
        self._len = 0  # host copy of the length; None after a compiled step moved it

    def reset(self):
        """Empty every request (the pools, table and their addresses stay)."""
        if self._lens is not None:
            self._lens.zero_()
        self._len = 0

    def get_seq_length(self, layer_idx: int = 0):
        """Tokens held per request: an int; a 0-d tensor while torch.compile traces."""
        if self._lens is None:
            return 0
        if torch.compiler.is_compiling():
            return self._lens.max()
        if self._len is None:
            self._len = int(self._lens.max())
        return self._len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.num_pages * self.page_size

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_max_length(), 0  # no host state: the attention applies the rule itself

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove tokens of every request (rejected drafts); the next
        tokens are written over them."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes minus the number of tokens to remove (transformers 5)")
        if tokens_to_remove and self._lens is not None:
            self._lens.sub_(-tokens_to_remove).clamp_(min=0)
            if self._len is not None:
                self._len = max(0, self._len + tokens_to_remove)

    def _allocate(self, B: int, device) -> None:
        """The table of a batch of B: request b owns pages b * W .. (b + 1) * W - 1."""
        if B > self._max_batch:
            raise ValueError(f"PagedE4M3Cache: batch {B} > max_batch_size {self._max_batch}")
        # a compiled first forward cannot check (a data-dependent branch): reset() first
        if self._lens is not None and not torch.compiler.is_compiling() and self.get_seq_length():
            raise ValueError(
                f"PagedE4M3Cache holds {self._lens.shape[0]} requests, the forward has {B}: "
                "call cache.reset() before a new batch"
            )
        # at most the capacity the kernels admit: every decode and verify step passes the whole table
        W = min(self.num_pages // B, admitted_capacity(self.page_size) // self.page_size)
        self._table = torch.arange(B * W, dtype=torch.int32, device=device).view(B, W)
        self._lens = torch.zeros(B, dtype=torch.int32, device=device)
        self._len = 0
        _static(self._table, self._lens)

    def _advance(self, B: int, Q: int, device) -> None:
        """Layer 0 of a forward: Q new tokens for each request."""
        t = self._table
        if t is None or t.shape[0] != B or t.device != torch.device(device):
            self._allocate(B, device)
        if torch.compiler.is_compiling():
            self._len = None  # no host read or check inside a graph: the device moves alone
        else:
            n = self.get_seq_length() + Q
            if n > self._table.shape[1] * self.page_size:
                raise RuntimeError(
                    f"PagedE4M3Cache is full: {n} tokens per request, {self._table.shape[1]} "
                    f"pages of {self.page_size} each (max_tokens / batch): raise max_tokens"
                )
            self._len = n
        self._lens.add_(Q)

    def _inputs(self, Q: int):
        """(slots [B * Q], pages, fresh) of the forward in progress. The op always gets the
        whole table (it reads only the pages it reaches): its split count follows the table's
        capacity, so eager and compiled steps must pass the same one to get the same bits.
        `pages`, the pages in use, cuts the table for the prefill route, which gathers every
        page it is given (None in a compiled step: no host copy of the length there); `fresh`
        marks a prompt (every request holds just these Q tokens)."""
        ps, table = self.page_size, self._table
        pos = self._lens.long()[:, None] - Q + torch.arange(Q, device=table.device)
        slots = (table.gather(1, pos // ps).long() * ps + pos % ps).flatten()
        if torch.compiler.is_compiling():
            return slots, None, False
        return slots, -(-self._len // ps), self._len == Q

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store the new tokens ([B, H_kv, Q, D]) and hand the attention its paged inputs
        through the model's kwargs; returns the new tokens (the attention reads the cache)."""
        B, H, Q, D = key_states.shape
        if layer_idx == 0:
            self._advance(B, Q, key_states.device)
        if torch.compiler.is_compiling():  # every layer computes them: no tensor kept on self
            slots, pages, fresh = self._inputs(Q)
        else:
            if layer_idx == 0:
                self._step = self._inputs(Q)
            slots, pages, fresh = self._step
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
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
            self._table,
            self._lens,
            layer.k_scale,
            layer.v_scale,
            pages,
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
    kc, vc, table, lens, ks, vs, pages, fresh = paged
    if query.dtype != torch.float16:
        raise TypeError(
            f"sm70attn attention needs a float16 model, got {query.dtype}: load it with "
            "dtype=torch.float16"
        )
    if query.shape[2] <= MAX_ROWS:
        out = sa.paged_attention(query, kc, vc, table, lens, scale=scaling, k_scale=ks, v_scale=vs)
    else:
        table = table if pages is None else table[:, :pages]
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
    if torch.compiler.is_compiling():  # a data-dependent check: eager forwards only (as
        return None  # generate() runs the prompt, where padding would come from)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "sm70attn attention: the batch has padding (attention_mask holds zeros); padding "
            "tokens would be written to the cache and attended. Generate each request alone "
            "(batch 1), or batch requests of equal length"
        )
    return None
