"""Hugging Face transformers: a paged E4M3 KV cache and the attention that reads it.

    from torch_sm70attn.integrations.transformers import PagedE4M3Cache, register

    register()  # attn_implementation="sm70attn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sm70attn", dtype=torch.float16)
    cache = PagedE4M3Cache(model.config, max_tokens=8192, max_batch_size=4)
    cache.calibrate(model, sample_ids)  # or k_scale=/v_scale=, or kv_scales_from_checkpoint()
    out = model.generate(ids, attention_mask=mask, cache=cache, do_sample=False)

No modeling code changes. The model calls `cache.update(key, value, layer_idx, kwargs=kwargs)`
and then the attention function with the same `kwargs`: `update` puts (cache, layer) into
them under "sm70attn", and the attention stores the new tokens with `store_kv` (it alone sees
the padding mask) and reads the pages: up to 16 query rows (decode, and verification of
speculative drafts) with `paged_attention`, longer queries (a prompt, a chunked prefill) with
SDPA over the dequantized pages; both apply the op's rule: row r of a request of length L sees
positions 0 .. L - Q + r. The new tokens are read back from the cache like every other token,
so a prompt, a verify step and a decode step see the same stored numbers.

Requests of one batch have their own lengths. Left padding (a tokenizer's attention_mask with
padding_side="left") is never stored nor attended: the mask function hands the attention the
new tokens' columns of the mask, the pad rows get slot -1, and each request's length counts
its real tokens only. `crop` takes one count for every request or a tensor of counts, one per
request, so requests of one batch can accept different numbers of drafts (`speculative.py`).
A forward keeps its state on the device, so `generate(..., compile_config=...)` and
`torch.compile(model, fullgraph=True)` trace a decode or verify step without a graph break.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

import torch_sm70attn as sa
from torch_sm70attn import paging
from torch_sm70attn.manifest import admitted_capacity, contract

NAME = "sm70attn"  # no "flash" in it: transformers would look for a flash-attention package
FP8 = torch.float8_e4m3fn
E4M3_MAX, MAX_ROWS = paging.E4M3_MAX, paging.MAX_ROWS
HEADROOM = 2.0  # calibrated scale = amax / 448 * HEADROOM: later tokens may be larger
_warned: set[str] = set()


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


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


# --- scales ------------------------------------------------------------------------------------
_SCALE_NAME = re.compile(r"^(.*?)layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k|v|kv)_scale$")


def kv_scales_from_checkpoint(
    path, prefix: str | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer KV-cache scales a quantized checkpoint carries, under the names vLLM reads:
    `model.layers.{i}.self_attn.k_scale` / `v_scale` (compressed-tensors, llm-compressor),
    `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale` (ModelOpt), or the older
    `self_attn.kv_scale` for both. Each is the dequantization multiplier (x = e4m3 * scale), a
    scalar or one per KV head. path: a folder of *.safetensors files or one file. prefix: what
    precedes "layers.N." in the names of the language model's layers (needed only where
    several stacks carry scales, e.g. a vision tower). Returns (k_scales, v_scales), one
    float32 tensor per layer, for PagedE4M3Cache(k_scale=, v_scale=)."""
    from safetensors import safe_open

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    stacks: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():
                m = _SCALE_NAME.match(key)
                if m and (prefix is None or m[1] == prefix):
                    t = fh.get_tensor(key).float().reshape(-1)
                    for which in ("k", "v") if m[3] == "kv" else (m[3],):
                        stacks.setdefault(m[1], {})[(int(m[2]), which)] = t
    if len(stacks) > 1:
        raise ValueError(
            f"{path}: KV-cache scales under several prefixes {sorted(stacks)}: pass "
            "prefix= the language model's"
        )
    found = next(iter(stacks.values()), {})
    if not found:
        raise ValueError(
            f"no KV-cache scales in {path} ({len(files)} safetensors files; looked for "
            "layers.N.self_attn.k_scale / v_scale, k_proj.k_scale / v_proj.v_scale, kv_scale)"
        )
    n = 1 + max(i for i, _ in found)
    missing = [f"{i}.{w}_scale" for i in range(n) for w in "kv" if (i, w) not in found]
    if missing:
        raise ValueError(f"{path}: KV-cache scales missing for layers {', '.join(missing[:8])}")
    return [found[(i, "k")] for i in range(n)], [found[(i, "v")] for i in range(n)]


def _per_layer(given, layers: int, what: str) -> list:
    """None or one scale (a float, or a tensor of 1 or H_kv values) for every layer, or a list
    or tuple of one such per layer; each checked here, on the host, once (the first forward,
    which may be compiled, only shapes them: `_as_scale`)."""
    if isinstance(given, (list, tuple)):
        if len(given) != layers:
            raise ValueError(
                f"PagedE4M3Cache: {what} is a list of {len(given)}; a list holds one scale per "
                f"layer ({layers}); give one scale for every layer as a float or a tensor of "
                "1 or H_kv values"
            )
        out = list(given)
    else:
        out = [given] * layers
    for s in out:
        if s is not None:
            v = torch.as_tensor(s, dtype=torch.float32).reshape(-1).cpu()
            if not bool((v > 0).all() & v.isfinite().all()):
                raise ValueError(f"PagedE4M3Cache: {what} must be finite and > 0, got {v.tolist()}")
    return out


def _as_scale(given, heads: int, device) -> torch.Tensor:
    """A checked scale (`_per_layer`) as float32 [H_kv] on the device: no data is read, so a
    compiled first forward traces it without a graph break."""
    s = torch.as_tensor(given, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() not in (1, heads):
        raise ValueError(f"PagedE4M3Cache: a scale must have 1 or H_kv={heads} values")
    return s.expand(heads).contiguous()


def _calibrated(x: torch.Tensor, valid, headroom: float) -> torch.Tensor:
    """amax per KV head of x [B, H, Q, D] over the real tokens / 448, times headroom."""
    a = x.detach().abs().float()
    if valid is not None:
        a = a * valid[:, None, :, None]
    amax = a.amax(dim=(0, 2, 3))
    return torch.where(amax > 0, amax / E4M3_MAX * headroom, 1.0).contiguous()


def text_config(config):
    """The language model's config (a multimodal config's text part)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids of a left-padded batch as generate() computes them: each request's real
    tokens count from 0 (padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _static(*tensors) -> None:
    """Tell torch.compile these tensors keep their address (CUDA graphs read them in place).
    Unguarded: a new cache of the same shapes reuses the compiled graph (CUDA graphs are
    recorded again for its addresses)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t, guard=False)


# --- the cache ---------------------------------------------------------------------------------
class _Layer(CacheLayerMixin):
    """One layer's pools and scales; the table and lengths live in the PagedE4M3Cache."""

    is_compileable = True
    is_croppable = True

    def __init__(self, cache: PagedE4M3Cache, k_scale=None, v_scale=None):
        super().__init__()
        self.cache = cache
        self.given = (k_scale, v_scale)  # the user's, or None: calibrated at the first write
        self.k_scale = self.v_scale = None

    def lazy_initialization(self, key_states, value_states):
        """Pools sized from the first tokens' heads and head dim (under tensor parallelism, the
        rank's own KV heads)."""
        c, (_, H, _, D) = self.cache, key_states.shape
        shape = (c.num_pages, c.page_size, H, D)
        self.keys = torch.zeros(shape, dtype=FP8, device=key_states.device)
        self.values = torch.zeros(shape, dtype=FP8, device=key_states.device)
        _static(self.keys, self.values)
        self.is_initialized = True

    def set_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """In place once they exist: a compiled graph keeps reading the same tensors."""
        if self.k_scale is None:
            self.k_scale, self.v_scale = k, v
            _static(self.k_scale, self.v_scale)
        else:
            self.k_scale.copy_(k)
            self.v_scale.copy_(v)

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("PagedE4M3Cache.update writes the layers")

    def get_mask_sizes(self, query_length):
        return self.cache.get_mask_sizes(query_length)

    def get_seq_length(self):
        return self.cache.get_seq_length()

    def get_max_length(self):
        return self.cache.get_max_length()

    def reset(self):  # the pools and scales stay; the cache resets the lengths
        pass


class PagedE4M3Cache(Cache):
    """A paged float8_e4m3fn KV cache for transformers models, usable under torch.compile
    and CUDA graphs (`is_compileable`).

    config: the model's config (its layer count). max_tokens: the token budget of the batch;
    every layer has max_tokens / page_size pages of [page_size, H_kv, D], H_kv and D taken
    from the first tokens stored (under tensor parallelism, the rank's own KV heads).
    max_batch_size: the largest batch. A batch of B requests gives each request max_tokens / B
    tokens of pages (its table's capacity; a request's results equal it alone when the
    capacity is the same). reserve: tokens each request will add after its prompt
    (max_new_tokens, plus the drafts of a verify step): the prompt is refused before anything
    is stored if a request's prompt + reserve does not fit, with the max_tokens it needs.

    Scales (k_scale, v_scale): a float, or a tensor of H_kv values, for every layer; or a list
    of one such per layer (`kv_scales_from_checkpoint` reads a quantized checkpoint's); or None
    (the default): each layer calibrates per KV head from the first tokens it stores (amax /
    448 with 2x headroom), which makes the scales, and so every request's tokens, depend on
    the first batch. `calibrate(model, sample_ids)` sets them from a sample instead. `reset()`
    keeps the scales (and the pools); only the lengths go. Values beyond 448 x scale saturate:
    the prompt and prefill forwards (more than 16 rows, eager) count them (`saturated`) and
    warn once with the fraction.

    State on the device: the block table (fixed once the batch is known), the lengths [B]
    int32 and a per-request full flag; a decode or verify forward reads nothing from the host,
    so a compiled step has no graph break and replays as a CUDA graph. A step past a request's
    pages (eager or compiled) stores nothing out of bounds: the flag records it, and the next
    host check raises (`check()`, `get_seq_length()`, the next eager forward, or generate()'s
    mask call before each step, a step or two late since it does not wait for the GPU);
    `reset()` warns about a flag nobody read. The first forward after a reset, and any eager
    forward of more than 16 rows, is checked on the host before it stores (the padding on the
    left; every request within its pages and the reserve).

    Reuse: a cache that holds tokens continues them, as transformers' caches do (to continue,
    pass the whole sequence so far); for a new prompt call reset() first. A forward whose
    tokens do not start at each request's length (a new prompt on a used cache: generate()
    feeds its last tokens past the cache's length) is flagged on the device and raised at the
    next host check, as an overflow is; after either, every forward raises until reset().
    """

    def __init__(
        self,
        config,
        max_tokens: int = 4096,
        max_batch_size: int = 1,
        page_size: int = 16,
        k_scale=None,
        v_scale=None,
        reserve: int = 0,
    ):
        cfg = text_config(config)
        if page_size < 1 or max_tokens < page_size or max_batch_size < 1 or reserve < 0:
            raise ValueError(
                "PagedE4M3Cache: need page_size >= 1, max_tokens >= page_size, a batch >= 1 "
                "and reserve >= 0"
            )
        self.page_size, self._max_batch, self.reserve = page_size, max_batch_size, reserve
        self.num_pages = math.ceil(max_tokens / page_size)
        n = cfg.num_hidden_layers
        ks, vs = _per_layer(k_scale, n, "k_scale"), _per_layer(v_scale, n, "v_scale")
        super().__init__(layers=[_Layer(self, ks[i], vs[i]) for i in range(n)])
        self._config = cfg  # for the attention implementation in error messages
        self._table = self._lens = None  # device [B, pages] int32 and [B] int32
        self._first = 0  # request(b) views: b
        self._root = self  # request(b) views: the cache they view (its counters, its batch)
        self._full = self._full_host = None  # device [B] bool: the request went past its pages
        self._astray = None  # device [B] bool: a forward's tokens did not start at its length
        self._step, self._empty = None, True  # the eager forward's slots; no forward since reset
        self._offsets = {}  # Q -> device [B, Q] int64: slot of row r of request b, less its length
        self._pending = None  # the layer whose attention has not read the cache yet
        self._calibrate = None  # headroom while calibrate() runs
        self.saturated = [0, 0]  # K and V values stored at +-448 by prompt forwards, of
        self.counted = 0  # this many values each
        self._warned, self._sat = False, []
        self._stale = None  # why the cache must be reset first (an error raised once said so)

    # -- lengths ---------------------------------------------------------------------------------
    def reset(self):
        """Empty every request (the pools, scales, table and their addresses stay). Warns if a
        request went past its pages since the last check (its last tokens were not stored)."""
        self._pending, self._step, self._empty = None, None, True
        self._root._stale = None
        self._sat.clear()
        if self._lens is not None:
            full = self._full.tolist()
            if any(full):
                warnings.warn(
                    f"PagedE4M3Cache.reset: request(s) "
                    f"{[self._first + b for b, f in enumerate(full) if f]} "
                    f"had gone past their {self.limit()} tokens: the tokens past it were not "
                    "stored and the outputs after that point are wrong; raise max_tokens",
                    stacklevel=2,
                )
            self._lens.zero_()
            self._clear_full()

    def get_seq_length(self, layer_idx: int = 0):
        """Tokens held by the longest request: an int (a device read); a 0-d tensor while
        torch.compile traces."""
        if self._lens is None:
            return 0
        if torch.compiler.is_compiling():
            return self._lens.max()
        self.check()
        return int(self._lens.max())

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0  # unused by the sm70attn mask; no device read per step

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.num_pages * self.page_size

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The mask function gets the new tokens' columns of the padding mask (see _mask).
        transformers calls this on the host before every forward (generate()'s compiled steps
        too), so the overflow flag is polled here."""
        if not torch.compiler.is_compiling():
            self._refuse_stale()
        self._poll()
        return query_length, 0

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    def capacity(self) -> int:
        """Tokens each request's pages hold (0 before the first forward)."""
        return 0 if self._table is None else self._table.shape[1] * self.page_size

    def limit(self) -> int:
        """Tokens each request of the current batch may hold: its pages, within the kernels'
        contract (a table may address part of a page more)."""
        return min(self.capacity(), contract())

    def check(self) -> None:
        """Raise if a step went past a request's pages (reads the device)."""
        if self._full is not None and not torch.compiler.is_compiling():
            self._raise_flags(self._full.tolist(), self._astray.tolist())

    def _poll(self) -> None:
        """Check the overflow flag without waiting for the GPU: read the copy made at the
        previous poll (complete once the host has synchronized since, as generate() does every
        step), then start the next copy."""
        if self._full is None or torch.compiler.is_compiling():
            return
        if not self._full.is_cuda:
            return self.check()
        if self._full_host is None or self._full_host.shape[1:] != self._full.shape:
            self._full_host = torch.zeros((2, *self._full.shape), dtype=torch.bool, pin_memory=True)
        self._raise_flags(*self._full_host.tolist())
        self._full_host[0].copy_(self._full, non_blocking=True)
        self._full_host[1].copy_(self._astray, non_blocking=True)

    def _clear_full(self) -> None:
        self._full.zero_()
        self._astray.zero_()
        if self._full_host is not None:  # no copy of the old flag may land after this
            torch.cuda.current_stream(self._full.device).synchronize()
            self._full_host.zero_()

    def _refuse_stale(self) -> None:
        """A forward on a cache that an earlier error left unusable (a request past its pages,
        tokens stored at another request's positions): reset() first."""
        if self._root._stale:
            raise RuntimeError(
                f"PagedE4M3Cache: {self._root._stale} (an earlier error said so), and the cache "
                "still holds it: call cache.reset() before the next prompt"
            )

    def _raise_flags(self, full: list[bool], astray: list[bool]) -> None:
        self._raise_full(full)
        if any(astray):
            self._root._stale = "a forward's tokens did not start at their requests' lengths"
            self._clear_full()
            which = [self._first + b for b, f in enumerate(astray) if f]
            raise RuntimeError(
                f"PagedE4M3Cache: a forward's tokens did not start at the length of request(s) "
                f"{which}: they do not continue what the cache holds, and were stored after it "
                "(a new prompt on a used cache: generate() feeds the prompt's tokens past the "
                "cache's length, or its last one). A cache that holds tokens continues them, as "
                "transformers' caches do (pass the whole sequence so far); for a new prompt call "
                "cache.reset() first"
            )

    def _raise_full(self, full: list[bool]) -> None:
        if any(full):
            cap, B = self.limit(), self._root._table.shape[0]
            self._root._stale = "a request went past its pages in an earlier forward"
            self._clear_full()
            which = [self._first + b for b, f in enumerate(full) if f]
            raise RuntimeError(
                f"PagedE4M3Cache is full: request(s) {which} went past their {cap} tokens "
                f"(max_tokens={self.num_pages * self.page_size} / batch of {B}); the tokens "
                f"past it were not stored. Use max_tokens >= {B} x (prompt + max_new_tokens + "
                "drafts), rounded up to pages (or reserve=), and cache.reset()"
            )

    def crop(self, tokens_to_remove) -> None:
        """Remove the last tokens of each request (rejected drafts); the next tokens are
        written over them. tokens_to_remove: minus the count for every request (an int <= 0,
        transformers' convention), or an integer tensor [B] of minus the count per request."""
        if torch.is_tensor(tokens_to_remove):
            if self._lens is None:
                raise ValueError("PagedE4M3Cache.crop: the cache holds no batch yet")
            n = tokens_to_remove.to(device=self._lens.device, dtype=torch.int32)
            if n.shape != self._lens.shape:
                raise ValueError(
                    f"PagedE4M3Cache.crop: {tuple(n.shape)} counts for {self._lens.shape[0]} "
                    "requests"
                )
            if not torch.compiler.is_compiling() and bool((n > 0).any()):
                raise ValueError("crop takes minus the number of tokens to remove (<= 0)")
            self._lens.add_(n).clamp_(min=0)
            return
        if tokens_to_remove > 0:
            raise ValueError("crop takes minus the number of tokens to remove (transformers 5)")
        if tokens_to_remove and self._lens is not None:
            self._lens.sub_(-tokens_to_remove).clamp_(min=0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: request i continues beam beam_idx[i]; its pages get a copy of that
        beam's pages in use (copies, since two beams may continue one), as DynamicCache's
        index_select copies the whole cache."""
        if self._lens is None:
            return
        beam_idx = beam_idx.to(self._lens.device)
        pages = -(-int(self._lens.max()) // self.page_size)
        src, dst = self._table[beam_idx, :pages].long(), self._table[:, :pages].long()
        for layer in self.layers:
            if layer.is_initialized:
                for pool in (layer.keys.view(torch.uint8), layer.values.view(torch.uint8)):
                    pool[dst] = pool[src]
        self._lens.copy_(self._lens[beam_idx])
        self._full.copy_(self._full[beam_idx])
        self._astray.copy_(self._astray[beam_idx])

    # -- one request of a running batch (continuous batching) ---------------------------------
    def request(self, b: int) -> PagedE4M3Cache:
        """The cache of request b alone: a batch of one over this cache's pools and scales and
        views of request b's pages, length and overflow flag, so that what a forward through it
        stores is request b's here (and its saturated values count here). A new request joins
        a running batch in a free slot b: its prompt's forward, eager, with
        `cache=cache.request(b)` after `release(b)`; the other requests are not touched, and the
        batch's steps run on this cache as before (speculative.serve does this)."""
        if self._lens is None:
            raise ValueError(
                "PagedE4M3Cache.request: the cache holds no batch yet: run the batch's first "
                "forward, or start(batch, device)"
            )
        B = self._lens.shape[0]
        if not 0 <= b < B:
            raise IndexError(f"PagedE4M3Cache.request: request {b} of a batch of {B}")
        view = copy.copy(self)
        view._table, view._lens, view._full, view._astray = (
            t[b : b + 1] for t in (self._table, self._lens, self._full, self._astray)
        )
        _static(view._table, view._lens, view._full, view._astray)
        view._max_batch, view._first, view._full_host, view._offsets = 1, self._first + b, None, {}
        view._pending, view._step, view._sat = None, None, []  # (its forwards are all checked)
        return view

    def release(self, b: int) -> None:
        """Empty request b (its length and flag; its pages are written over by the next
        request); the others go on. Warns, as reset() does, if it had gone past its pages
        unread."""
        self.request(b).reset()

    def _uncalibrated(self) -> bool:
        """Whether a layer's scales are still to be calibrated from the first tokens stored."""
        return any(layer.k_scale is None and None in layer.given for layer in self.layers)

    def start(self, batch: int, device) -> None:
        """Make the table of a batch of `batch` empty requests on `device` before any forward
        (the first forward does it otherwise), for requests that join one by one. The table,
        lengths and flags of the same batch size and device are kept (a compiled step's CUDA
        graph reads them where they are): they must be empty (reset() first)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self._table
        if t is not None and t.shape[0] == batch and t.device == device:
            if self.get_seq_length():
                raise ValueError("PagedE4M3Cache.start: the cache holds requests: reset() first")
            return
        self._allocate(batch, device)

    # -- calibration -----------------------------------------------------------------------------
    def scales(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each layer's (k_scale, v_scale) as float32 [H_kv] copies, as stored with: given, a
        checkpoint's, or calibrated (by calibrate() or the first forward); None for a layer
        that has not calibrated yet. Another cache given them (k_scale=, v_scale=) stores the
        same values."""
        return tuple(
            [
                None if x is None else x.detach().clone()
                for x in (getattr(l, w) for l in self.layers)
            ]
            for w in ("k_scale", "v_scale")
        )

    @torch.no_grad()
    def calibrate(self, model, input_ids, attention_mask=None, headroom: float = HEADROOM):
        """Set every layer's scales from one forward of a sample (its real tokens: padding is
        left out): amax per KV head / 448 x headroom. The scales then stay, through reset(),
        for every batch: a request's tokens no longer depend on the other requests. Returns
        self, empty."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pos = positions(attention_mask)
        self.reset()
        self._calibrate, reserve, self.reserve = headroom, self.reserve, 0
        try:
            model(
                input_ids, attention_mask=attention_mask, position_ids=pos, cache=self,
                logits_to_keep=1,
            )  # fmt: skip
        finally:
            self._calibrate, self.reserve = None, reserve
            self.reset()
        return self

    # -- a forward ----------------------------------------------------------------------------------
    def _allocate(self, B: int, device) -> None:
        """The table of a batch of B: request b owns pages b * W .. (b + 1) * W - 1."""
        if self._root is not self:
            raise ValueError(
                f"PagedE4M3Cache.request({self._first}): a view takes one request on "
                f"{self._table.device}, the forward has {B} on {device}"
            )
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
        if W < 1:
            raise ValueError(
                f"PagedE4M3Cache: {self.num_pages} pages for a batch of {B}: raise max_tokens"
            )
        self._table = torch.arange(B * W, dtype=torch.int32, device=device).view(B, W)
        self._lens = torch.zeros(B, dtype=torch.int32, device=device)
        self._full = torch.zeros(B, dtype=torch.bool, device=device)
        self._astray = torch.zeros(B, dtype=torch.bool, device=device)
        self._full_host, self._offsets, self._pending, self._step = None, {}, None, None
        _static(self._table, self._lens, self._full, self._astray)

    def _prompt_checks(self, Q: int, valid) -> tuple[int, bool]:
        """An eager forward of more than MAX_ROWS rows (a prompt, a prefill chunk): one device
        read, then refuse what would not fit or is not left padding before anything is stored.
        Returns (pages in use after the step, fresh: every request holds just these tokens)."""
        self.check()
        lens = self._lens.tolist()
        if valid is None:
            n = [Q] * len(lens)
            self._real = Q * len(lens)
        else:
            if bool((valid[:, 1:] < valid[:, :-1]).any()):
                raise ValueError(
                    "sm70attn attention: the attention_mask has a zero after a one: only left "
                    "padding (padding_side='left') is supported. generate() derives a mask from "
                    "pad_token_id when none is given, so a prompt containing that token needs "
                    "attention_mask=torch.ones_like(ids)"
                )
            n = valid.sum(1).tolist()
        self._real = sum(n)  # real tokens of this forward (_count)
        need = [a + b for a, b in zip(lens, n, strict=True)]
        fresh = not any(lens) and all(k == Q for k in n)
        reserve = self.reserve if not any(lens) else 0
        if max(need) + reserve > self.limit():
            raise self._over_budget(max(need), reserve)
        return -(-max(need) // self.page_size), fresh

    def _over_budget(self, need: int, reserve: int = 0, who: str = "a request") -> RuntimeError:
        """The error for a request of `need` tokens plus `reserve` that its pages (limit())
        cannot hold, with the max_tokens that would (or the kernels' contract)."""
        cap, ps, want = self.limit(), self.page_size, need + reserve
        B = self._root._table.shape[0]  # (a request(b) view: its batch's)
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

    def _advance(self, Q: int, valid) -> None:
        """Layer 0 of a forward: each request's real new tokens. A request they would take
        past its pages stops at its capacity and is marked full (raised at the next host
        check); a full request stores nothing more."""
        cap = self.limit()
        self._lens.add_(Q if valid is None else valid.sum(1, dtype=torch.int32))
        over = self._lens > cap
        self._lens.clamp_(max=cap)
        self._full.logical_or_(over)

    def _slots(self, Q: int, valid) -> torch.Tensor:
        """The slots [B * Q] of the new tokens, after _advance: -1 for padding and for a full
        request. A request's pages are consecutive (`_allocate`), so position p of the request
        whose first page is f is slot f * page_size + p."""
        skip = self._full[:, None] if valid is None else self._full[:, None] | ~valid
        return (self._lens[:, None] + self._offset(Q)).masked_fill_(skip, -1).flatten()

    def _offset(self, Q: int) -> torch.Tensor:
        """[B, Q] int64: first page x page_size - Q + r (made once per Q outside a compiled
        graph)."""
        off = None if torch.compiler.is_compiling() else self._offsets.get(Q)
        if off is None:
            first = self._table[:, :1].long() * self.page_size
            off = first - Q + torch.arange(Q, device=first.device)
            if not torch.compiler.is_compiling():
                self._offsets[Q] = off
        return off

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Hand the attention this cache and the layer through the model's kwargs; the
        attention stores the new tokens (it sees the padding mask). Returns the new tokens."""
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise TypeError(
                "PagedE4M3Cache: the model did not pass its attention kwargs to cache.update("
                "..., kwargs=...), so the sm70attn attention cannot find the paged cache"
            )
        if not torch.compiler.is_compiling():
            if self._pending is not None:
                self._pending = None
                impl = getattr(self._config, "_attn_implementation", None)
                why = (
                    f"its attn_implementation is {impl!r}, not {NAME!r}"
                    if impl != NAME
                    else f"the config this cache was built from says {NAME!r}, so this cache "
                    "was built from another model's config, or this model's attention was "
                    "changed since: build the cache from the config of the model that runs it, "
                    "PagedE4M3Cache(model.config, ...)"
                )
                raise RuntimeError(
                    f"PagedE4M3Cache: the model's attention did not read the cache ({why}). "
                    f"Call torch_sm70attn.integrations.transformers.register() and load the "
                    f"model with attn_implementation={NAME!r}, or model.set_attn_implementation("
                    f"{NAME!r}). Two models built from one config object share it: "
                    "from_config(cfg, attn_implementation=...) writes into cfg, so give each "
                    "model its own copy.deepcopy(cfg). Then cache.reset()"
                )
            self._pending = layer_idx
        attn_kwargs[NAME] = (self, layer_idx)
        return key_states, value_states

    def store(self, layer_idx: int, key_states, value_states, valid, position_ids=None):
        """Store the new tokens ([B, H_kv, Q, D]; valid: bool [B, Q] or None, False for
        padding; position_ids [B or 1, Q], the model's, if it passes them) of one layer; returns
        what the attention reads: (key_cache, value_cache, table, lens, k_scale, v_scale, pages,
        fresh, valid). `pages` (eager prefill only, else None) cuts the table for the prefill
        route, which gathers every page it is given; `fresh` marks a prompt without padding
        (plain causal attention there). A request whose first new token's position is not its
        length is flagged (on the device; raised at the next host check)."""
        B, H, Q, D = key_states.shape
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self._pending = None
        if valid is not None and (valid.dim() != 2 or valid.shape != (B, Q)):
            valid = None if valid.dim() != 2 else valid[:, -Q:]
        if valid is not None:
            valid = valid.bool()
        if layer_idx == 0:
            t = self._table
            if t is None or t.shape[0] != B or t.device != key_states.device:
                self._allocate(B, key_states.device)
            pages, fresh = None, False
            if not compiling:
                # a prompt, a prefill or a request(b) view's chunk of one: one device read
                if Q > MAX_ROWS or self._empty or self._root is not self:
                    pages, fresh = self._prompt_checks(Q, valid)
                    pages = pages if Q > MAX_ROWS else None
                self._empty = False
            if position_ids is not None:
                first = position_ids.reshape(-1, position_ids.shape[-1])[:, 0]
                self._astray.logical_or_(first.to(self._lens.dtype) != self._lens)
            self._advance(Q, valid)
            if not compiling:  # every layer of an eager forward reuses them
                self._step = (self._slots(Q, valid), pages, fresh)
        if compiling or self._step is None:  # (compiled: no tensor kept on self)
            slots, pages, fresh = self._slots(Q, valid), None, False
        else:
            slots, pages, fresh = self._step
            if layer_idx == len(self.layers) - 1:
                self._step = None  # a later layer 0 that runs compiled cannot leave it stale
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if self._calibrate is not None or layer.k_scale is None:
            self._scales(layer, key_states, value_states, valid)
        k = key_states.transpose(1, 2).reshape(B * Q, H, D).half()
        v = value_states.transpose(1, 2).reshape(B * Q, H, D).half()
        sa.store_kv(
            k, v, layer.keys, layer.values, slots, k_scale=layer.k_scale, v_scale=layer.v_scale
        )
        if (Q > MAX_ROWS or self._root is not self) and not compiling and self._calibrate is None:
            self._count(layer_idx, key_states, value_states, valid, layer)
        return (
            layer.keys,
            layer.values,
            self._table,
            self._lens,
            layer.k_scale,
            layer.v_scale,
            pages,
            fresh,
            valid,
        )

    def _scales(self, layer, key_states, value_states, valid) -> None:
        """The user's scales, else (and always while calibrate() runs) calibrated from x."""
        H, dev = key_states.shape[1], key_states.device
        head = HEADROOM if self._calibrate is None else self._calibrate
        k, v = (
            _as_scale(given, H, dev)
            if given is not None and self._calibrate is None
            else _calibrated(x, valid, head)
            for given, x in zip(layer.given, (key_states, value_states), strict=True)
        )
        layer.set_scales(k, v)

    def _count(self, layer_idx, key_states, value_states, valid, layer) -> None:
        """Saturated values of a prompt forward, counted on the device (one read at the last
        layer); a warning once per cache with the fraction."""
        H, D = key_states.shape[1], key_states.shape[3]
        for x, s in ((key_states, layer.k_scale), (value_states, layer.v_scale)):
            over = x.abs() > (E4M3_MAX * s).to(x.dtype).view(1, -1, 1, 1)
            if valid is not None:
                over &= valid[:, None, :, None]
            self._sat.append(over.sum())
        root = self._root  # a request(b) view counts into its cache
        root.counted += H * D * self._real
        if layer_idx == len(self.layers) - 1:
            got = torch.stack(self._sat).view(-1, 2).sum(0).tolist()
            self._sat.clear()
            root.saturated = [a + b for a, b in zip(root.saturated, got, strict=True)]
            if any(root.saturated) and not root._warned:
                root._warned = True
                frac = [f"{n / max(root.counted, 1):.3%}" for n in root.saturated]
                warnings.warn(
                    f"PagedE4M3Cache: {frac[0]} of the K and {frac[1]} of the V values stored "
                    "so far saturated at 448 x scale (larger than the scales allow). Calibrate "
                    "on representative text (cache.calibrate(model, ids)) or give larger scales",
                    stacklevel=4,
                )


# --- the attention -----------------------------------------------------------------------------
def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention: query [B, H_q, Q, D]; returns ([B, Q, H_q, D], None)."""
    paged = kwargs.get(NAME)
    if paged is not None and not torch.compiler.is_compiling():
        paged[0]._pending = None  # this attention reads the cache (or raises below)
    if dropout:
        raise ValueError("sm70attn attention: dropout is not supported (use model.eval())")
    if paged is None:
        return _unpaged(query, key, value, attention_mask, scaling), None
    cache, layer_idx = paged
    if query.dtype != torch.float16:
        raise TypeError(
            f"sm70attn attention needs a float16 model, got {query.dtype}: load it with "
            "dtype=torch.float16"
        )
    kc, vc, table, lens, ks, vs, pages, fresh, valid = cache.store(
        layer_idx, key, value, attention_mask, kwargs.get("position_ids")
    )
    out = paging.attend(query, kc, vc, table, lens, scaling, ks, vs, pages=pages, fresh=fresh)
    return out.transpose(1, 2), None


def _unpaged(query, key, value, padding, scale):
    """Another cache (DynamicCache, or none): key/value hold every position; the op's rule and
    the padding mask [B, T], SDPA. Stock attention, with a one-time warning."""
    if not torch.compiler.is_compiling():
        _warn_once(
            "unpaged",
            "sm70attn attention ran without a PagedE4M3Cache (the model's own cache, float16, "
            "plain SDPA): pass cache=PagedE4M3Cache(model.config, max_tokens=..., "
            "max_batch_size=...) to generate() or the forward to use the FP8 pages and the "
            "fused kernels",
        )
    B, Q, T = query.shape[0], query.shape[2], key.shape[2]
    lens = torch.full((B,), T, dtype=torch.int32, device=query.device)
    mask = sa.verifier_mask(lens, Q, T)
    if padding is not None and padding.dim() == 2 and padding.shape[-1] == T:
        mask = mask & padding.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
    )
    if padding is not None:  # a row that sees nothing (padding) is 0, not NaN
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0)
    return out.transpose(1, 2)


def _mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """The mask function of NAME: no mask is built (the attention applies the op's rule); the
    attention gets the padding mask's last kv_length columns (bool [B, kv_length]), which for a
    PagedE4M3Cache are the new tokens (its get_mask_sizes answers q_length), so that padding
    is neither stored nor attended; for another cache, every position's."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    return attention_mask[:, -kv_length:]
