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
`paged_attention_varlen`, which reads the pages where they are (no dequantized copy of the
past); both apply the op's rule: row r of a request of length L sees
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

import functools
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

import torch_sm70attn as sa
from torch_sm70attn import paging
from torch_sm70attn.paging import SlotTable, StepPlan, static_address

NAME = "sm70attn"  # no "flash" in it: transformers would look for a flash-attention package
FP8 = torch.float8_e4m3fn
MAX_ROWS = paging.MAX_ROWS  # more query rows take the prefill route
HEADROOM = 2.0  # calibrated scale = amax / 448 * HEADROOM: later tokens may be larger
# The keys of the one-time warnings given in this process. Public for the tests, which drop a
# key to see its warning again.
warned: set[str] = set()


MIN_TRANSFORMERS = (5, 24)  # generate(cache=...), the attention and mask interfaces used here


def version_refusal(version: str) -> str | None:
    """Why this transformers release cannot take the adapter, or None. (Older ones drop the
    cache argument with "model_kwargs are not used by the model: ['cache']".)"""
    have = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if have >= MIN_TRANSFORMERS:
        return None
    want = ".".join(map(str, MIN_TRANSFORMERS))
    return (
        f"torch_sm70attn's transformers adapter needs transformers >= {want}, this is {version}: "
        f"pip install 'transformers>={want}'"
    )


if (_why := version_refusal(transformers.__version__)) is not None:
    raise ImportError(_why)


def register(name: str = NAME) -> str:
    """Register the attention and its mask function under `name`, and show generate()'s
    input_ids to a PagedE4M3Cache (`_watch_generate`). Idempotent."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask_function)
    _watch_generate()
    return name


def _watch_generate() -> None:
    """Wrap transformers' GenerationMixin.prepare_inputs_for_generation (once) so that a
    PagedE4M3Cache passed to generate() sees each step's whole input_ids before the step
    (`PagedE4M3Cache._generating`). The model's forward gets only the ids past the cache's
    length (generate slices them there), so inside it a new prompt longer than what the cache
    holds looks like a continuation: both start at the cache's length. Only generate holds the
    ids the cache is meant to hold; this is where it hands them to the model."""
    from transformers import GenerationMixin

    prepare = GenerationMixin.prepare_inputs_for_generation
    if getattr(prepare, "_sm70attn", False):
        return

    @functools.wraps(prepare)  # its signature too: generate inspects it
    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, PagedE4M3Cache):
            cache._generating(input_ids, kwargs)
        return prepare(self, input_ids, *args, **kwargs)

    prepare_inputs_for_generation._sm70attn = True
    GenerationMixin.prepare_inputs_for_generation = prepare_inputs_for_generation


def compile_config(**kw):
    """transformers' CompileConfig for generate() through the sm70attn backend: fullgraph,
    mode "reduce-overhead" (CUDA graphs: inductor's where Triton runs, the backend's own
    recorder on a V100); `kw` overrides. Without one, generate() compiles the decode steps of a
    compileable cache on any GPU with inductor, which cannot target a V100. On a CPU generate
    compiles nothing with any CompileConfig (transformers compiles on GPUs only): its steps run
    eagerly; torch.compile(model, backend="sm70attn") compiles there too."""
    from transformers import CompileConfig

    return CompileConfig(**{"fullgraph": True, "backend": NAME, "mode": "reduce-overhead", **kw})


def _warn_once(key: str, msg: str) -> None:
    if key not in warned:
        warned.add(key)
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


def text_config(config):
    """The language model's config (a multimodal config's text part)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids of a left-padded batch as generate() computes them: each request's real
    tokens count from 0 (padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# --- token ids (the calls that take them: calibrate, the speculative loops) ------------------
def _vocab(model) -> int | None:
    return getattr(text_config(model.config), "vocab_size", None)


def _is_ids(t: torch.Tensor) -> bool:
    """An integer tensor (token ids): not floating point, complex or bool."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _check_vocab(ids: torch.Tensor, vocab: int | None, what: str) -> None:
    """ids (non-empty) within [0, vocab), the model's vocab_size (None: not known)."""
    if vocab is not None and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise ValueError(
            f"{what} holds token ids outside [0, {vocab}), the model's vocab_size (ids of "
            "another tokenizer?)"
        )


def _check_batch(ids, mask, vocab: int | None, who: str) -> None:
    """A batch of prompts (who: the call taking it, for the errors): input_ids a [B, T] integer
    tensor of ids in [0, vocab), T >= 1, attention_mask (if given) of its shape, with at least
    one token a row."""
    want = "a [B, T] integer tensor (torch.tensor([ids]) for one request)"
    if not torch.is_tensor(ids):
        raise TypeError(f"{who}: input_ids is a {type(ids).__name__}; pass {want}")
    if ids.dim() != 2:
        fix = ": ids[None] for one request" if ids.dim() == 1 else ""
        raise ValueError(f"{who}: input_ids is {ids.dim()}-D {list(ids.shape)}; pass {want}{fix}")
    if not _is_ids(ids):
        raise TypeError(f"{who}: input_ids is a {ids.dtype} tensor; pass {want}")
    if ids.numel() == 0:
        raise ValueError(
            f"{who}: input_ids {list(ids.shape)} holds no tokens; each request needs one"
        )
    _check_vocab(ids, vocab, f"{who}: input_ids")
    if mask is None:
        return
    if not torch.is_tensor(mask) or mask.shape != ids.shape:
        got = list(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(
            f"{who}: attention_mask is {got}, input_ids {list(ids.shape)}: pass one of its shape"
        )
    empty = (mask.to("cpu") == 0).all(1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"{who}: attention_mask row {empty[0]} holds no tokens; each request needs one"
        )


# --- the cache ---------------------------------------------------------------------------------
class _Layer(CacheLayerMixin):
    """One layer's pools and scales; the table and lengths are the PagedE4M3Cache's (its
    slot_table)."""

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
        static_address(self.keys, self.values)
        self.is_initialized = True

    def set_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """In place once they exist: a compiled graph keeps reading the same tensors."""
        if self.k_scale is None:
            self.k_scale, self.v_scale = k, v
            static_address(self.k_scale, self.v_scale)
        else:
            self.k_scale.copy_(k)
            self.v_scale.copy_(v)

    def write(self, key_states, value_states, slots) -> None:
        """Store the new tokens ([B, H_kv, Q, D]) at `slots` ([B * Q], -1: none) at the
        layer's scales."""
        B, H, Q, D = key_states.shape
        k = key_states.transpose(1, 2).reshape(B * Q, H, D).half()
        v = value_states.transpose(1, 2).reshape(B * Q, H, D).half()
        sa.store_kv(k, v, self.keys, self.values, slots, k_scale=self.k_scale, v_scale=self.v_scale)

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


class _Scales:
    """A cache's scales as its layers store with them, and what they saturate: the user's
    (`_Layer.given`), else calibrated from the first tokens a layer stores (HEADROOM), or from
    every forward while calibrate() runs (`calibrating`: its headroom); the saturated values of
    the prompt forwards (`saturation`, a paging.Saturation), warned about once. One object for a
    cache and its request(b) views."""

    def __init__(self):
        self.calibrating: float | None = None  # headroom while calibrate() runs
        self.saturation = paging.Saturation()

    def store_with(self, layer: _Layer, key_states, value_states, valid) -> None:
        """Set the layer's scales where they are still to be set (or calibrate() runs)."""
        if self.calibrating is None and layer.k_scale is not None:
            return
        H, dev = key_states.shape[1], key_states.device
        head = HEADROOM if self.calibrating is None else self.calibrating
        k, v = (
            paging.device_scale(given, H, dev)
            if given is not None and self.calibrating is None
            else paging.calibrated_scale(x, valid, head)
            for given, x in zip(layer.given, (key_states, value_states), strict=True)
        )
        layer.set_scales(k, v)

    def count(self, layer_idx, last: bool, key_states, value_states, valid, layer, tokens):
        """Saturated values of a prompt forward, counted on the device (one read at the last
        layer); a warning once per cache with the fraction. Not while compiling or calibrating."""
        if torch.compiler.is_compiling() or self.calibrating is not None:
            return
        sat = self.saturation
        if layer_idx == 0:
            sat.start(tokens)
        sat.add(key_states, value_states, layer.k_scale, layer.v_scale, valid)
        if last and sat.read():
            frac = [f"{x:.3%}" for x in sat.fractions()]
            warnings.warn(
                f"PagedE4M3Cache: {frac[0]} of the K and {frac[1]} of the V values stored "
                "so far saturated at 448 x scale (larger than the scales allow). Calibrate "
                "on representative text (cache.calibrate(model, ids)) or give larger scales",
                stacklevel=4,
            )

    def calibrate(self, cache, model, input_ids, attention_mask, headroom: float) -> None:
        """PagedE4M3Cache.calibrate: one forward of the sample through `cache` (emptied before
        and after, no reserve), every layer's scales calibrated from it with `headroom`."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pos = positions(attention_mask)
        cache.reset()
        self.calibrating, reserve, cache.reserve = headroom, cache.reserve, 0
        try:
            model(
                input_ids, attention_mask=attention_mask, position_ids=pos, cache=cache,
                logits_to_keep=1,
            )  # fmt: skip
        finally:
            self.calibrating, cache.reserve = None, reserve
            cache.reset()

    @staticmethod
    def of(layers) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each layer's (k_scale, v_scale) as float32 copies; None where not calibrated yet."""
        return tuple(
            [
                None if x is None else x.detach().clone()
                for x in (getattr(l, w) for l in layers)
            ]
            for w in ("k_scale", "v_scale")
        )


def _unread_error(config) -> RuntimeError:
    """update() handed the cache to a layer whose attention never read it: the model's
    attention is not this backend's (its config says why)."""
    impl = getattr(config, "_attn_implementation", None)
    why = (
        f"its attn_implementation is {impl!r}, not {NAME!r}"
        if impl != NAME
        else f"the config this cache was built from says {NAME!r}, so this cache "
        "was built from another model's config, or this model's attention was "
        "changed since: build the cache from the config of the model that runs it, "
        "PagedE4M3Cache(model.config, ...)"
    )
    return RuntimeError(
        f"PagedE4M3Cache: the model's attention did not read the cache ({why}). "
        f"Call torch_sm70attn.integrations.transformers.register() and load the "
        f"model with attn_implementation={NAME!r}, or model.set_attn_implementation("
        f"{NAME!r}). Two models built from one config object share it: "
        "from_config(cfg, attn_implementation=...) writes into cfg, so give each "
        "model its own copy.deepcopy(cfg). Then cache.reset()"
    )


def _attention_kwargs(kwargs) -> dict:
    """The attention kwargs the model passed to cache.update(..., kwargs=...)."""
    attn_kwargs = kwargs.get("kwargs")
    if not isinstance(attn_kwargs, dict):
        raise TypeError(
            "PagedE4M3Cache: the model did not pass its attention kwargs to cache.update("
            "..., kwargs=...), so the sm70attn attention cannot find the paged cache"
        )
    return attn_kwargs


def _new_columns(valid, B: int, Q: int):
    """The padding mask the attention got as bool [B, Q] over the new tokens: a 2-D mask's last
    Q columns; None for none or another shape."""
    if valid is not None and (valid.dim() != 2 or valid.shape != (B, Q)):
        valid = None if valid.dim() != 2 else valid[:, -Q:]
    return None if valid is None else valid.bool()


class PagedE4M3Cache(Cache):
    """A paged float8_e4m3fn KV cache for transformers models, usable under torch.compile
    and CUDA graphs (`is_compileable`).

    config: the model's config (`model.config`; only its layer count is read). max_tokens: the
    token budget of the batch; every layer has max_tokens / page_size pages of [page_size,
    H_kv, D], H_kv and D taken from the first tokens stored (under tensor parallelism, the
    rank's own KV heads), never from the config: a config of other heads or head dim sizes the
    pools as the model's own would.
    max_batch_size: the largest batch. A batch of B requests gives each request max_tokens / B
    tokens of pages (its table's capacity; a request's results equal it alone when the
    capacity is the same). reserve: tokens each request will add after its prompt
    (max_new_tokens, plus the drafts of a verify step): the prompt is refused before anything
    is stored if a request's prompt + reserve does not fit, with the max_tokens it needs.

    Scales (k_scale, v_scale, both or neither): a float, or a tensor of H_kv values, for every
    layer; or a list of one such per layer (`kv_scales_from_checkpoint` reads a quantized
    checkpoint's); or None (the default): each layer calibrates per KV head from the first
    tokens it stores (amax / 448 with 2x headroom), which makes the scales, and so every
    request's tokens, depend on the first batch. `calibrate(model, sample_ids)` sets them from
    a sample instead. `reset()` keeps the scales (and the pools); only the lengths go. Values
    beyond 448 x scale saturate: the prompt and prefill forwards (more than 16 rows, eager)
    count them (`saturated`) and warn once with the fraction.

    State on the device: the block table (fixed once the batch is known), the lengths [B] int32
    and per-request flags (`slot_table`, a paging.SlotTable; read through `table`, `lens` and
    `full`); each layer's pools and scales (`layers`); the saturation counts (`saturation`, a
    paging.Saturation). The host's side of the table, its step plan and checks are `pager`'s (a
    paging.Pager); the scales' source and the counts, `quant`'s. A decode or verify forward
    reads nothing from the host, so a compiled step has no graph break and replays as a CUDA
    graph. A step past a request's pages (eager or compiled) stores nothing out of bounds: the
    flag records it, and the next host check raises (`check()`, `get_seq_length()`, the next
    eager forward, or generate()'s mask call before each step, a step or two late since it does
    not wait for the GPU); `reset()` warns about a flag nobody read. The first forward after a
    reset, and any eager forward of more than 16 rows, is checked on the host before it stores
    (the padding on the left; every request within its pages and the reserve).

    Reuse: a cache that holds tokens continues them, as transformers' caches do (to continue,
    pass the whole sequence so far); for a new prompt call reset() first. generate() on a used
    cache refuses, before anything is stored, input_ids that do not start with the ids the
    cache holds or are no longer than them (a new prompt, of any length: generate() would feed
    it past the cache's length as a continuation); `register()` shows the cache generate()'s
    input_ids. A forward whose tokens do not start at each request's length (a direct call
    with other positions) is flagged on the device and raised at the next host check, as an
    overflow is; after either flag, every forward raises until reset().
    """

    def __init__(self, config, max_tokens: int = 4096, max_batch_size: int = 1,
                 page_size: int = 16, k_scale=None, v_scale=None, reserve: int = 0):  # fmt: skip
        cfg = _check_config(config)
        self.pager = paging.Pager(max_tokens, page_size, max_batch_size, reserve)
        self.reserve = reserve
        n = cfg.num_hidden_layers
        ks = paging.per_layer_scales(k_scale, n, "PagedE4M3Cache: k_scale")
        vs = paging.per_layer_scales(v_scale, n, "PagedE4M3Cache: v_scale")
        if (k_scale is None) != (v_scale is None):
            given, missing = ("k_scale", "v_scale") if v_scale is None else ("v_scale", "k_scale")
            raise ValueError(
                f"PagedE4M3Cache: {given} given without {missing}: give both (a checkpoint's: "
                "kv_scales_from_checkpoint(folder) returns both), or neither to calibrate both "
                "from the first forward or cache.calibrate(model, ids)"
            )
        super().__init__(layers=[_Layer(self, ks[i], vs[i]) for i in range(n)])
        self._config = cfg  # for the attention implementation in error messages
        self.quant = _Scales()  # the scales' source, and the saturation counts
        self.saturation = self.quant.saturation  # of prompt forwards (request(b) views' too)
        self._unread = None  # the layer update() handed the cache to, until its attention reads it

    # -- what it holds -----------------------------------------------------------------------------
    page_size = property(lambda self: self.pager.page_size, doc="Tokens a page holds.")
    num_pages = property(lambda self: self.pager.num_pages, doc="Pages of each layer's pools.")

    @property
    def max_batch_size(self) -> int:
        """The largest batch (1 for a request(b) view)."""
        return self.pager.max_batch

    @property
    def slot_table(self) -> SlotTable | None:
        """The batch's paging.SlotTable (the pager's); None before the first forward or start()."""
        return self.pager.slot_table

    @property
    def plan(self) -> StepPlan | None:
        """The plan of the eager forward under way (made at its layer 0; None between forwards)."""
        return self.pager.plan

    @property
    def table(self) -> torch.Tensor | None:
        """The block table on the device, [B, W] int32 (request b's pages are table[b]); None
        before the first forward or start()."""
        return None if self.slot_table is None else self.slot_table.table

    @property
    def lens(self) -> torch.Tensor | None:
        """Tokens held per request on the device, [B] int32; None before the first forward or
        start()."""
        return None if self.slot_table is None else self.slot_table.lens

    @property
    def full(self) -> torch.Tensor | None:
        """Per request on the device, [B] bool: a step went past its pages since the last host
        check; None before the first forward or start()."""
        return None if self.slot_table is None else self.slot_table.full

    @property
    def saturated(self) -> list[int]:
        """K and V values stored saturated at +-448 by prompt forwards, of `counted` each."""
        return self.saturation.saturated

    counted = property(lambda self: self.saturation.counted, doc="Values counted, K and V each.")

    def uncalibrated(self) -> bool:
        """Whether a layer's scales are still to be calibrated from the first tokens stored."""
        return any(layer.k_scale is None and None in layer.given for layer in self.layers)

    # -- lengths ---------------------------------------------------------------------------------
    def reset(self):
        """Empty every request (the pools, scales, table and their addresses stay). Warns if a
        request went past its pages since the last check (its last tokens were not stored)."""
        self._unread = self._seen_ids = None
        self.pager.reset(stacklevel=3)

    def get_seq_length(self, layer_idx: int = 0):
        """Tokens held by the longest request: an int (a device read); a 0-d tensor while
        torch.compile traces."""
        if self.slot_table is not None and torch.compiler.is_compiling():
            return self.slot_table.lens.max()
        return self.pager.length()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0  # unused by the sm70attn mask; no device read per step

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.num_pages * self.page_size

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The mask function gets the new tokens' columns of the padding mask (see
        mask_function). transformers calls this on the host before every forward (generate()'s
        compiled steps too), so the overflow flag is polled here."""
        if not torch.compiler.is_compiling():
            self.pager.poll()
        return query_length, 0

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    def capacity(self) -> int:
        """Tokens each request's pages hold (0 before the first forward)."""
        return 0 if self.slot_table is None else self.slot_table.capacity

    def limit(self) -> int:
        """Tokens each request of the current batch may hold: its pages, within the kernels'
        contract (a table may address part of a page more); 0 before the first forward."""
        return self.pager.limit()

    def check(self) -> None:
        """Raise if a step went past a request's pages (reads the device)."""
        self.pager.check()

    def over_budget_error(
        self, need: int, reserve: int = 0, who: str = "a request"
    ) -> RuntimeError:
        """The error for a request of `need` tokens plus `reserve` that its pages (limit())
        cannot hold, with the max_tokens that would (or the kernels' contract)."""
        return self.pager.over_budget_error(need, reserve, who)

    def crop(self, tokens_to_remove) -> None:
        """Remove the last tokens of each request (rejected drafts); the next tokens are
        written over them. tokens_to_remove: minus the count for every request (an int <= 0,
        transformers' convention), or an integer tensor [B] of minus the count per request."""
        self.pager.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: request i continues beam beam_idx[i]; its pages get a copy of that
        beam's pages in use (copies, since two beams may continue one), as DynamicCache's
        index_select copies the whole cache."""
        if self.slot_table is not None:
            pools = [p for l in self.layers if l.is_initialized for p in (l.keys, l.values)]
            self.slot_table.reorder(beam_idx, pools)

    # -- one request of a running batch (continuous batching) ---------------------------------
    def request(self, b: int) -> PagedE4M3Cache:
        """The cache of request b alone: a batch of one over this cache's pools and scales and
        views of request b's pages, length and overflow flag, so that what a forward through it
        stores is request b's here (and its saturated values count here). A new request joins
        a running batch in a free slot b: its prompt's forward, eager, with
        `cache=cache.request(b)` after `release(b)`; the other requests are not touched, and the
        batch's steps run on this cache as before (speculative.serve does this)."""
        return _Request(self, self.pager.request(b))

    def release(self, b: int) -> None:
        """Empty request b (its length and flag; its pages are written over by the next
        request); the others go on. Warns, as reset() does, if it had gone past its pages
        unread."""
        self.request(b).reset()

    def start(self, batch: int, device) -> None:
        """Make the table of a batch of `batch` empty requests on `device` before any forward
        (the first forward does it otherwise), for requests that join one by one. The table,
        lengths and flags of the same batch size and device are kept (a compiled step's CUDA
        graph reads them where they are): they must be empty (reset() first)."""
        if self.pager.start(batch, device):
            self._unread = self._seen_ids = None

    # -- calibration -----------------------------------------------------------------------------
    def scales(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each layer's (k_scale, v_scale) as float32 [H_kv] copies, as stored with: given, a
        checkpoint's, or calibrated (by calibrate() or the first forward); None for a layer
        that has not calibrated yet. Another cache given them (k_scale=, v_scale=) stores the
        same values."""
        return _Scales.of(self.layers)

    @torch.no_grad()
    def calibrate(self, model, input_ids, attention_mask=None, headroom: float = HEADROOM):
        """Set every layer's scales from one forward of a sample (its real tokens: padding is
        left out): amax per KV head / 448 x headroom. The scales then stay, through reset(),
        for every batch: a request's tokens no longer depend on the other requests. input_ids:
        a [B, T] integer tensor of the model's token ids, checked as speculative.generate checks
        its own (attention_mask: its shape, 0 for left padding). Returns self, empty."""
        _check_batch(input_ids, attention_mask, _vocab(model), "PagedE4M3Cache.calibrate")
        self.quant.calibrate(self, model, input_ids, attention_mask, headroom)
        return self

    # -- generate() ---------------------------------------------------------------------------------
    _seen_ids: torch.Tensor | None = None  # the input_ids of generate()'s last step through here

    def _generating(self, input_ids, kwargs) -> None:
        """generate()'s input_ids ([B, T], the whole sequence so far) before a step's forward
        (`_watch_generate`; kwargs: the step's). Its first step on a cache that holds tokens,
        where the attention mask is as wide as input_ids (not a chunked prefill), must continue
        them: input_ids longer than what the cache holds and starting with the ids of the last
        step through it (the ids it holds), else the prompt is refused before anything is
        stored (two host reads: the length, the comparison). The other steps keep a reference
        to input_ids and read nothing (decode stays asynchronous)."""
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            return
        mask = kwargs.get("attention_mask")
        whole = mask is None or mask.dim() != 2 or mask.shape[1] == input_ids.shape[1]
        if kwargs.get("is_first_iteration") and whole and not self.pager.empty:
            self._check_continues(input_ids)
        self._seen_ids = input_ids

    def _check_continues(self, ids: torch.Tensor) -> None:
        """Refuse generate()'s ids [B, T] unless they continue what the cache holds."""
        self.pager.refuse_if_stale()
        held = self.get_seq_length()
        if not held:
            return
        (B, T), seen, differ = ids.shape, self._seen_ids, []
        if T > held and seen is not None and seen.shape[0] == B:  # else the batch check says
            n = min(held, seen.shape[1])
            differ = (ids[:, :n] != seen[:, :n].to(ids.device)).any(1).nonzero().flatten().tolist()
        if T > held and not differ:
            return
        why = (
            f"request(s) {differ} do not start with the ids it holds"
            if differ
            else f"they are {T} tokens, not more than the {held} it holds"
        )
        raise ValueError(
            f"PagedE4M3Cache holds up to {held} tokens a request and generate()'s input_ids "
            f"{[B, T]} do not continue them ({why}): a new prompt on a used cache, which "
            "generate() would slice past the tokens held as if it continued them. For a new "
            "prompt call cache.reset() first; to continue, pass the whole sequence so far (the "
            "last output's ids, then the new ones). Nothing was stored"
        )

    # -- a forward ----------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Hand the attention this cache and the layer through the model's kwargs; the
        attention stores the new tokens (it sees the padding mask). Returns the new tokens."""
        attn_kwargs = _attention_kwargs(kwargs)
        _check_layer(layer_idx, len(self.layers))
        if not torch.compiler.is_compiling():
            if self._unread is not None:
                self._unread = None
                raise _unread_error(self._config)
            self._unread = layer_idx
        attn_kwargs[NAME] = (self, layer_idx)
        return key_states, value_states

    def _mark_read(self) -> None:
        """The attention has the cache that update() handed it: the next update() goes on."""
        if not torch.compiler.is_compiling():
            self._unread = None

    def store(self, layer_idx: int, key_states, value_states, valid, position_ids=None):
        """Store the new tokens ([B, H_kv, Q, D]; valid: bool [B, Q] or None, False for
        padding; position_ids [B or 1, Q], the model's, if it passes them) of one layer.
        Returns (layer, plan): the layer (its pools `keys`, `values` and scales `k_scale`,
        `v_scale`) and the step's paging.StepPlan, made at layer 0 (an eager forward's other
        layers reuse it: `self.plan`). A request whose first new token's position is not its
        length is flagged (on the device; raised at the next host check)."""
        B, _, Q, _ = key_states.shape
        self._mark_read()
        valid, last = _new_columns(valid, B, Q), layer_idx == len(self.layers) - 1
        plan, tokens = self.pager.step(layer_idx, len(self.layers), B, Q, valid, position_ids,
                                       key_states.device, self.reserve)  # fmt: skip
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        self.quant.store_with(layer, key_states, value_states, plan.valid)
        layer.write(key_states, value_states, plan.slots)
        if Q > MAX_ROWS or self.pager.root is not self.pager:  # a prompt, a view's chunk
            self.quant.count(layer_idx, last, key_states, value_states, plan.valid, layer, tokens)
        return layer, plan


def _check_config(config):
    """The language model's config of what PagedE4M3Cache was given: a transformers config
    with num_hidden_layers, not the model itself."""
    if isinstance(config, torch.nn.Module):
        raise TypeError(
            f"PagedE4M3Cache takes the model's config, got the model ({type(config).__name__}): "
            "pass model.config"
        )
    cfg = text_config(config)
    if not isinstance(getattr(cfg, "num_hidden_layers", None), int):
        raise TypeError(
            f"PagedE4M3Cache takes the model's config (its num_hidden_layers), got a "
            f"{type(config).__name__}: pass model.config"
        )
    return cfg


def _check_layer(layer_idx: int, layers: int) -> None:
    if not 0 <= layer_idx < layers:
        raise ValueError(
            f"PagedE4M3Cache: the model's attention layer {layer_idx} has no pages here: this "
            f"cache holds {layers} layers (the num_hidden_layers of the config it was made "
            "from); make it from this model's config: PagedE4M3Cache(model.config, ...)"
        )


class _Request(PagedE4M3Cache):
    """Request b of a PagedE4M3Cache's batch (`PagedE4M3Cache.request`): the cache's layers
    (pools and scales), its scales' source and saturation counts, and request b's pager
    (paging.Pager.request: a batch of one over views of its row of the table, its length and
    flags, every forward checked on the host). Its own: the reserve (from the cache's) and the
    update()/attention handshake."""

    def __init__(self, cache: PagedE4M3Cache, pager: paging.Pager):  # no super().__init__
        Cache.__init__(self, layers=cache.layers)
        self.pager = pager
        self.reserve, self._config = cache.reserve, cache._config
        self.quant, self.saturation = cache.quant, cache.saturation
        self._unread = None


# --- the attention -----------------------------------------------------------------------------
def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention: query [B, H_q, Q, D]; returns ([B, Q, H_q, D], None)."""
    paged = kwargs.get(NAME)
    if paged is not None:
        paged[0]._mark_read()  # (or raises below)
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
    layer, plan = cache.store(layer_idx, key, value, attention_mask, kwargs.get("position_ids"))
    out = paging.attend(
        query, layer.keys, layer.values, plan.table, plan.lens, scaling, layer.k_scale,
        layer.v_scale, pages=plan.pages,
    )  # fmt: skip
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


def mask_function(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """The mask function of NAME: no mask is built (the attention applies the op's rule); the
    attention gets the padding mask's last kv_length columns (bool [B, kv_length]), which for a
    PagedE4M3Cache are the new tokens (its get_mask_sizes answers q_length), so that padding
    is neither stored nor attended; for another cache, every position's."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    return attention_mask[:, -kv_length:]
