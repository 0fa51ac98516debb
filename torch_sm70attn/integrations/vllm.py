"""vLLM: the E4M3 KV-cache attention backend a V100 lacks, as a plugin.

    pip install -e '.[cuda12,vllm]'     # in the checkout: torch 2.10.0, vllm 0.19.1
    vllm serve MODEL --attention-backend CUSTOM --kv-cache-dtype fp8_e4m3 --dtype float16

vLLM loads `register` through its `vllm.general_plugins` entry point in every process; it
registers `SM70AttnBackend` as the CUSTOM attention backend. What it serves: float16
activations, kv_cache_dtype "fp8" / "fp8_e4m3" (vLLM allocates the cache as uint8: it is viewed
as float8_e4m3fn), the manifest's head dims and group sizes, block sizes that are multiples of
16, decoder self-attention. Anything else is refused when vLLM validates the backend at startup,
naming the option to change.

A step, as vLLM hands it over (query [T, H_q, D] packed request after request, with
query_start_loc, seq_lens, the block table and the slot mapping):
- the store: `sa.store_kv` at vLLM's slots (-1, padding, stores nothing), before the attention;
- the attention, one op call a layer-step: a step of decodes and speculative verifies only
  (up to 16 query rows a request; vLLM sends a verify as an ordinary causal query of 1 + k
  rows, and `reorder_batch_threshold` puts them first) is one `sa.paged_attention` call, each
  request's rows placed last in a [B, H_q, rows, D] query (`paging.ragged_rows`); with
  uniform batches (every request 1 + k rows) a full CUDA graph replays it (UNIFORM_BATCH). A
  step with a prompt or a chunk of more rows in it (chunked prefill; a prompt whose prefix
  is cached is a chunk over that past) is one `sa.paged_attention_varlen` call over vLLM's
  packed tokens as they lie, every request of the step in it.
Every route reads the stored E4M3 pages where they are, never a float16 copy of them. Scales: the layer's
`_k_scale` / `_v_scale` (a checkpoint's, `--calculate-kv-scales`, or vLLM's default 1.0).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

import torch_sm70attn as sa
from torch_sm70attn import paging
from torch_sm70attn.manifest import MANIFEST, admitted_capacity

# a child of vLLM's logger, so its handler prints the startup lines with vLLM's own
log = logging.getLogger("vllm.torch_sm70attn")

NAME = "CUSTOM"  # the AttentionBackendEnum member vLLM selects with --attention-backend CUSTOM
# vLLM releases this backend serves: 0.17-0.19 (torch 2.10.0, the newest with V100 code; its
# classes tested in CI with 0.19.1). 0.26 (torch 2.11, CUDA 13: no V100 code) only where
# PROXY_ENV is 1: the newer GPU this package is measured on stands in for a V100 there, and
# its runs (tools/vllm_e2e.py) are 0.26's only tests.
SUPPORTED = ((0, 17), (0, 18), (0, 19))
PROXY, PROXY_ENV = (0, 26), "TORCH_SM70ATTN_VLLM_PROXY"
KV_DTYPES = ("fp8", "fp8_e4m3")
BLOCK_MULTIPLE = 16


def version_refusal(version: str | None = None) -> str | None:
    """Why this vLLM release is not served, or None."""
    if version is None:
        import vllm

        version = vllm.__version__
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = None
    proxy = os.environ.get(PROXY_ENV) == "1"
    if major_minor in SUPPORTED or (proxy and major_minor == PROXY):
        return None
    served = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
    also = (
        f" ({PROXY[0]}.{PROXY[1]} only with {PROXY_ENV}=1, for runs on newer GPUs)"
        if major_minor == PROXY
        else ""
    )
    return (
        f"torch_sm70attn's vLLM backend serves vLLM {served}, not {version}{also}: on a V100 "
        "install vllm==0.19.1 (with torch 2.10.0)"
    )


def register() -> None:
    """The `vllm.general_plugins` entry point: registers SM70AttnBackend as vLLM's CUSTOM
    attention backend (chosen with --attention-backend CUSTOM). On a release it was not
    written for it still registers, and the backend refuses at validation with the reason, so
    other backends go on working."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    why = version_refusal()
    if why:
        log.warning(why)
    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.SM70AttnBackend")


@dataclass
class SM70AttnMetadata:
    """One step, for every layer: vLLM's tensors (on the device) for its `num_reqs` requests,
    of which the first `num_decodes` are decodes and verifies (`num_decode_tokens` tokens, at
    most `rows` rows each; `uniform`: each exactly `rows`, padding requests of none aside).
    Where every request is one (`decode_only`) the step takes paged_attention, else
    paged_attention_varlen."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    rows: int
    uniform: bool

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_reqs


def _routes_line(threshold: int) -> str:
    return (
        f"torch_sm70attn: decode and verify steps of up to {threshold} query rows a request "
        "-> sm70attn.paged_attention (fused E4M3 kernels; full CUDA graphs for uniform batches); "
        "steps with a prefill or a chunk of more rows -> sm70attn.paged_attention_varlen (one "
        "call, the E4M3 pages read in place); KV stored by sm70attn.store_kv"
    )


class SM70AttnMetadataBuilder(AttentionMetadataBuilder[SM70AttnMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # decodes and verifies (1 + k rows) first; the op takes up to MAX_ROWS rows
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.reorder_batch_threshold = min(self.reorder_batch_threshold, paging.MAX_ROWS)
        self.block_size = kv_cache_spec.block_size
        max_len = vllm_config.model_config.max_model_len
        capacity = math.ceil(max_len / self.block_size) * self.block_size
        if capacity > admitted_capacity(self.block_size):
            raise ValueError(
                f"torch_sm70attn serves contexts up to {MANIFEST.max_context} tokens, the model's "
                f"max_model_len is {max_len}: pass --max-model-len {MANIFEST.max_context} or less"
            )
        if torch.device(device).type == "cuda":
            self._preload(kv_cache_spec, vllm_config, device)
        log.info(_routes_line(self.reorder_batch_threshold))

    def _preload(self, spec, vllm_config, device) -> None:
        """Load every kernel a full CUDA graph may capture, now: vLLM captures its uniform
        decode and verify batches without a warm-up run first, and no kernel can be loaded
        inside a capture. The kernel depends on the rows, the table's capacity and the layout
        (a batch of each captured size, over a cache laid out as vLLM's, is called once)."""
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        H_q, H_kv, D = mc.get_num_attention_heads(pc), spec.num_kv_heads, spec.head_size
        spec_cfg = vllm_config.speculative_config
        k = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
        sizes = vllm_config.compilation_config.cudagraph_capture_sizes or []
        width = -(-mc.max_model_len // self.block_size)
        cache = torch.zeros(1, 2, self.block_size, H_kv, D, dtype=torch.uint8, device=device)
        kc, vc = _fp8_caches(cache)
        calls = 0
        for rows in sorted({1, min(1 + k, paging.MAX_ROWS)}):
            for B in sorted(
                {min(vllm_config.scheduler_config.max_num_seqs, -(-n // rows)) for n in sizes}
            ):
                q = torch.zeros(B * rows, H_q, D, dtype=torch.float16, device=device)
                qsl = torch.arange(0, B * rows + 1, rows, dtype=torch.int32, device=device)
                table = torch.zeros(B, width, dtype=torch.int32, device=device)
                lens = torch.zeros(B, dtype=torch.int32, device=device)
                # the uniform batch's own call (a full CUDA graph captures exactly this)
                paging.attend_packed(q, kc, vc, table, qsl, lens, 1.0, 1.0, 1.0, rows=rows,
                                     uniform=True, tokens=B * rows)  # fmt: skip
                calls += 1
        torch.cuda.synchronize(device)
        log.info("torch_sm70attn: kernels of %d captured batch shapes loaded before capture", calls)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SM70AttnMetadata:
        m = common_attn_metadata
        nd, _, ndt, _ = split_decodes_and_prefills(m, decode_threshold=self.reorder_batch_threshold)
        qsl = m.query_start_loc_cpu
        q_lens = (qsl[1 : nd + 1] - qsl[:nd]).tolist()
        rows = max(q_lens, default=0)
        B = m.num_reqs
        return SM70AttnMetadata(
            query_start_loc=m.query_start_loc[: B + 1],
            seq_lens=m.seq_lens[:B],
            block_table=m.block_table_tensor[:B],
            num_reqs=B,
            num_decodes=nd,
            num_decode_tokens=ndt,
            rows=rows,
            uniform=_uniform(q_lens, rows, ndt),
        )


def _uniform(q_lens: list[int], rows: int, tokens: int) -> bool:
    """Every decode request has `rows` query rows, but for padding requests of none after them
    (a full CUDA graph's batch): the step's tokens are then [requests, rows] as they lie."""
    real = sum(1 for n in q_lens if n)
    return (
        bool(q_lens)
        and tokens == rows * len(q_lens)
        and q_lens == [rows] * real + [0] * (len(q_lens) - real)
    )


def _fp8_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's [num_blocks, 2, block_size, H_kv, D] uint8 cache as the op's key and value caches
    [num_blocks, block_size, H_kv, D] float8_e4m3fn (views, interleaved per block)."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    return kv_cache[:, 0], kv_cache[:, 1]


class SM70AttnImpl(AttentionImpl[SM70AttnMetadata]):
    supports_quant_query_input = False  # the query stays float16

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks=None,
        **kwargs,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        refusals = [
            (alibi_slopes is not None, "ALiBi"),
            (sliding_window is not None, "a sliding window"),
            (bool(logits_soft_cap), "a logits soft-cap"),
            (sinks is not None, "attention sinks"),
            (attn_type != AttentionType.DECODER, f"attention type {attn_type}"),
            (kv_sharing_target_layer_name is not None, "KV sharing across layers"),
        ]
        for refused, what in refusals:
            if refused:
                raise NotImplementedError(
                    f"torch_sm70attn's vLLM backend does not serve {what}: this model needs "
                    "another --attention-backend"
                )
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"torch_sm70attn's vLLM backend reads an E4M3 cache: pass --kv-cache-dtype "
                f"fp8_e4m3 (got {kv_cache_dtype!r})"
            )
        group = num_heads // num_kv_heads
        if num_heads % num_kv_heads or group not in MANIFEST.group_sizes:
            raise ValueError(
                f"torch_sm70attn serves {MANIFEST.group_sizes[0]}-{MANIFEST.group_sizes[-1]} "
                f"query heads per KV head, this layer has {num_heads}/{num_kv_heads} (under "
                "tensor parallelism, a rank's own heads)"
            )
        if head_size not in MANIFEST.head_dims:
            raise ValueError(
                f"torch_sm70attn serves head sizes {MANIFEST.head_dims}, not {head_size}"
            )
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Store the step's K/V [T, H_kv, D] float16 at vLLM's slots (-1: nothing); vLLM pads
        the tokens past the slots it gives."""
        kc, vc = _fp8_caches(kv_cache)
        n = slot_mapping.shape[0]
        sa.store_kv(
            key[:n], value[:n], kc, vc, slot_mapping, k_scale=layer._k_scale,
            v_scale=layer._v_scale,
        )  # fmt: skip

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SM70AttnMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, H_q, D] float16 (the K/V are stored already: do_kv_cache_update); writes
        output [T, H_q, D] and returns it."""
        if output is None:
            raise ValueError("torch_sm70attn's vLLM backend writes into vLLM's output buffer")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("torch_sm70attn: no fused output quantization")
        if attn_metadata is None:  # vLLM's profile and warm-up runs
            return output.fill_(0)
        m, H, D = attn_metadata, self.num_heads, self.head_size
        out = output.view(-1, H, D)
        kc, vc = _fp8_caches(kv_cache)
        ks, vs = layer._k_scale, layer._v_scale
        o = paging.attend_packed(
            query.view(-1, H, D), kc, vc, m.block_table, m.query_start_loc, m.seq_lens,
            self.scale, ks, vs, rows=m.rows if m.decode_only else None, uniform=m.uniform,
            tokens=m.num_decode_tokens,
        )  # fmt: skip
        out[: o.shape[0]].copy_(o)
        return output


class SM70AttnBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = list(KV_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[SM70AttnImpl]:
        return SM70AttnImpl

    @staticmethod
    def get_builder_cls() -> type[SM70AttnMetadataBuilder]:
        return SM70AttnMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(MANIFEST.head_dims)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) >= MANIFEST.min_compute_capability

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, *args, **kw):
        """vLLM's checks, each reason naming what to change; the release first."""
        reasons = super().validate_configuration(
            head_size, dtype, kv_cache_dtype, block_size, *args, **kw
        )
        hints = {
            "head_size not supported": f"head size {head_size} (torch_sm70attn serves "
            f"{list(MANIFEST.head_dims)})",
            "dtype not supported": f"dtype {dtype}: torch_sm70attn serves float16 activations, "
            "pass --dtype float16",
            "kv_cache_dtype not supported": f"kv cache dtype {kv_cache_dtype!r}: pass "
            "--kv-cache-dtype fp8_e4m3",
            "block_size not supported": f"block size {block_size}: pass --block-size 16 (a "
            f"multiple of {BLOCK_MULTIPLE})",
            "compute capability not supported": "compute capability below sm_70",
        }
        reasons = [hints.get(r, r) for r in reasons]
        why = version_refusal()
        return ([why] if why else []) + reasons
