"""The vLLM backend (torch_sm70attn.integrations.vllm) on the CPU, with vLLM's own classes: its
config (the shipped model's, an n-gram speculative config of 7 drafts), the metadata builder,
CommonAttentionMetadata of mixed batches as vLLM's model runner lays them out, the plugin's
entry point and the refusals. The outputs are compared with an FP64 oracle over the E4M3 values
an independent encoder gives (tests/oracle.py). Runs where vLLM is installed (CI: torch 2.10.0
with vllm 0.19.1; vLLM 0.26, the newer GPUs' release, with TORCH_SM70ATTN_VLLM_PROXY=1)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from oracle import decode_e4m3, encode_e4m3, rel_err

vllm = pytest.importorskip("vllm")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import torch_sm70attn  # noqa: E402
from torch_sm70attn.integrations import vllm as backend  # noqa: E402

H_Q, H_KV, D, PS = 12, 2, 256, 16  # the shipped model's attention; vLLM's default block size
DRAFTS = 7


def vllm_config(drafts=DRAFTS, max_len=4096):
    mc = ModelConfig(model=str(torch_sm70attn.model_path()), dtype="float16", max_model_len=max_len)
    pc = ParallelConfig()
    spec = None
    if drafts:
        spec = SpeculativeConfig(
            method="ngram", num_speculative_tokens=drafts, prompt_lookup_max=4,
            prompt_lookup_min=2, target_model_config=mc, target_parallel_config=pc,
        )  # fmt: skip
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=PS, cache_dtype="fp8_e4m3"),
        parallel_config=pc,
        speculative_config=spec,
        device_config=DeviceConfig(device="cpu"),
    )


def builder(cfg=None):
    spec = FullAttentionSpec(PS, num_kv_heads=H_KV, head_size=D, dtype=torch.uint8)
    return backend.SM70AttnMetadataBuilder(spec, ["l0"], cfg or vllm_config(), torch.device("cpu"))


def impl(**kw):
    args = dict(num_heads=H_Q, head_size=D, scale=D**-0.5, num_kv_heads=H_KV)
    args.update(kw)
    return backend.SM70AttnImpl(kv_cache_dtype=args.pop("kv_cache_dtype", "fp8_e4m3"), **args)


class Step:
    """One engine step over a paged cache: requests (past tokens, new query rows), each with
    its own pages (a shuffled block table, as vLLM's allocator hands them out), K/V of every
    position in float16, and CommonAttentionMetadata as the model runner builds it (requests
    in the order given: decodes first; `pad` tokens past the real ones with slot -1)."""

    def __init__(self, requests, *, pad=0, pad_reqs=0, seed=0, blocks=64):
        g = torch.Generator().manual_seed(seed)
        self.requests, self.blocks = requests, blocks
        width = max(-(-(p + q) // PS) for p, q in requests) + 1
        perm = torch.randperm(blocks, generator=g)
        B = len(requests) + pad_reqs
        self.table = torch.zeros(B, width, dtype=torch.int32)
        used = 0
        for b, (p, q) in enumerate(requests):
            n = -(-(p + q) // PS)
            self.table[b, :n] = perm[used : used + n].int()
            used += n
        self.k = [torch.randn(p + q, H_KV, D, generator=g).half() * 3 for p, q in requests]
        self.v = [torch.randn(p + q, H_KV, D, generator=g).half() for p, q in requests]
        self.q = [torch.randn(q, H_Q, D, generator=g).half() for _, q in requests]
        self.ks = torch.tensor(0.02)  # one scale a layer, as vLLM's _k_scale
        self.vs = torch.tensor(0.01)
        self.layer = SimpleNamespace(_k_scale=self.ks, _v_scale=self.vs)
        q_lens = [q for _, q in requests] + [0] * pad_reqs
        seq = [p + q for p, q in requests] + [0] * pad_reqs
        self.qsl = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32)
        self.T = int(self.qsl[-1]) + pad
        slots = [self.slot(b, t) for b, (p, q) in enumerate(requests) for t in range(p, p + q)]
        self.common = CommonAttentionMetadata(
            query_start_loc=self.qsl.clone(),
            query_start_loc_cpu=self.qsl.clone(),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            num_reqs=B,
            num_actual_tokens=self.T,
            max_query_len=max(q_lens),
            max_seq_len=max(seq),
            block_table_tensor=self.table,
            slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        )

    def slot(self, b, t):
        return int(self.table[b, t // PS]) * PS + t % PS

    def kv_cache(self):
        """vLLM's cache (uint8), every request's past stored through the backend's store."""
        cache = torch.zeros(self.blocks, 2, PS, H_KV, D, dtype=torch.uint8)
        for b, (p, _) in enumerate(self.requests):
            slots = torch.tensor([self.slot(b, t) for t in range(p)], dtype=torch.int64)
            impl().do_kv_cache_update(self.layer, self.k[b][:p], self.v[b][:p], cache, slots)
        return cache

    def new_tokens(self, which):
        """The step's packed new K or V [T, H_KV, D], padding tokens random."""
        parts = [x[p:] for x, (p, _) in zip(which, self.requests, strict=True)]
        pad = torch.randn(self.T - int(self.qsl[len(self.requests)]), H_KV, D).half()
        return torch.cat(parts + [pad])

    def query(self):
        pad = torch.randn(self.T - int(self.qsl[len(self.requests)]), H_Q, D).half()
        return torch.cat(self.q + [pad])

    def oracle(self, b):
        """FP64 [q, H_Q, D] of request b: the op's rule over the E4M3 values of its K/V."""
        p, q = self.requests[b]
        k = self._e4m3(self.k[b], self.ks)
        v = self._e4m3(self.v[b], self.vs)
        rows = self.q[b].double().transpose(0, 1)  # [H_Q, q, D]
        kk = k.repeat_interleave(H_Q // H_KV, dim=1).transpose(0, 1)  # [H_Q, L, D]
        vv = v.repeat_interleave(H_Q // H_KV, dim=1).transpose(0, 1)
        s = rows @ kk.transpose(1, 2) * D**-0.5
        visible = torch.arange(p + q)[None, :] <= torch.arange(p, p + q)[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        return (torch.softmax(s, -1) @ vv).transpose(0, 1)

    @staticmethod
    def _e4m3(x, scale):
        codes = encode_e4m3((x.float() / scale).numpy())
        return decode_e4m3(torch.from_numpy(codes).view(torch.float8_e4m3fn)) * float(scale)


def run(step, b=None):
    """The backend over one step, as vLLM's attention layer calls it: store, then forward into
    a poisoned output buffer. Returns (output, metadata, cache)."""
    b = b or builder()
    cache = step.kv_cache()
    i = impl()
    slots = step.common.slot_mapping
    i.do_kv_cache_update(step.layer, step.new_tokens(step.k), step.new_tokens(step.v), cache, slots)
    m = b.build(0, step.common)
    out = torch.full((step.T, H_Q * D), float("nan"), dtype=torch.float16)
    got = i.forward(step.layer, step.query(), None, None, cache, m, output=out)
    assert got is out
    return out.view(step.T, H_Q, D), m, cache


def check(step, out):
    for b, (_, q) in enumerate(step.requests):
        s = int(step.qsl[b])
        err = rel_err(out[s : s + q], step.oracle(b))
        assert err < 2e-3, (b, step.requests[b], err)


def test_mixed_batch():
    """Decodes, an 8-row verify, a prompt and a chunk over a past in one step (vLLM's order:
    decodes and verifies first, by reorder_batch_threshold = 1 + 7 drafts), two padding tokens:
    every real row equals the oracle."""
    step = Step([(40, 1), (100, 8), (17, 1), (0, 37), (50, 30)], pad=2)
    out, m, _ = run(step)
    assert (m.num_decodes, m.rows, m.uniform) == (3, 8, False)
    assert (m.num_reqs, m.decode_only) == (5, False)
    check(step, out)


def test_uniform_verify_batch_with_padded_requests():
    """A full CUDA graph's batch: every request 1 + 7 rows, then requests vLLM pads with no
    tokens and length 0."""
    step = Step([(33, 8), (70, 8), (8, 8)], pad_reqs=2, pad=16, seed=1)
    out, m, _ = run(step)
    assert (m.num_decodes, m.rows, m.uniform, m.decode_only) == (5, 8, True, True)
    check(step, out)
    step = Step([(33, 8), (70, 8), (8, 8)], pad_reqs=2, seed=1)  # tokens not padded: ragged
    out, m, _ = run(step)
    assert (m.num_decodes, m.rows, m.uniform) == (5, 8, False)
    check(step, out)
    step = Step([(33, 8), (70, 8), (8, 8)], seed=1)
    out, m, _ = run(step)
    assert (m.num_decodes, m.rows, m.uniform) == (3, 8, True)
    check(step, out)


def test_short_prompt_is_a_decode_and_verify_threshold():
    """A prompt of at most 1 + drafts tokens goes through the op too (the rule is the same);
    without speculative decoding the threshold is 1 (plain decodes)."""
    step = Step([(9, 1), (0, 5), (20, 3)], seed=2)
    out, m, _ = run(step)
    assert (m.num_decodes, m.decode_only) == (3, True)
    check(step, out)
    b = builder(vllm_config(drafts=0))
    assert b.reorder_batch_threshold == 1
    step = Step([(9, 1), (0, 5), (20, 3)], seed=2)
    out, m, _ = run(step, b)
    assert m.num_decodes == 1 and not m.decode_only
    check(step, out)


@pytest.mark.parametrize(
    "requests, pad, op",
    [
        ([(40, 1), (100, 8), (17, 1), (0, 37), (50, 30)], 2, "paged_attention_varlen"),
        ([(0, 300)], 0, "paged_attention_varlen"),  # a prompt alone
        ([(33, 8), (70, 8), (8, 8)], 0, "paged_attention"),  # verifies only
        ([(33, 1), (70, 1)], 3, "paged_attention"),  # decodes only
    ],
)
def test_a_layer_step_is_one_op_call(monkeypatch, requests, pad, op):
    """Whatever the mix, forward makes one attention call a layer-step, through the paging
    core: paged_attention_varlen where a prefill or chunk is in the step, paged_attention for
    decodes and verifies alone."""
    calls = []
    for name in ("paged_attention", "paged_attention_varlen"):
        real = getattr(torch_sm70attn, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(torch_sm70attn, name, counted)
    step = Step(requests, pad=pad, seed=4)
    out, _, _ = run(step)
    assert calls == [op]
    check(step, out)
    if op == "paged_attention_varlen":  # the padding tokens' rows: 0, not left as they were
        assert out[int(step.qsl[-1]) :].eq(0).all()


def test_store_writes_only_the_given_slots():
    """Slots -1 (padding; vLLM's profile run) store nothing; the rest land where the slot says,
    as the encoder's bytes."""
    step = Step([(0, 20)], pad=4, seed=3)
    cache = torch.zeros(step.blocks, 2, PS, H_KV, D, dtype=torch.uint8)
    slots = step.common.slot_mapping
    k, v = step.new_tokens(step.k), step.new_tokens(step.v)
    impl().do_kv_cache_update(step.layer, k, v, cache, torch.full_like(slots, -1))
    assert not cache.any()
    impl().do_kv_cache_update(step.layer, k, v, cache, slots)
    flat = cache.view(step.blocks, 2, PS, H_KV * D).transpose(0, 1).reshape(2, -1, H_KV * D)
    want = encode_e4m3((k[:20].float() / step.ks).numpy()).reshape(20, -1)
    assert np.array_equal(flat[0, slots[:20]].numpy(), want)
    assert int((flat[0].sum(-1) != 0).sum()) <= 20


def test_startup_log_names_each_route():
    """The builder says at startup, through vLLM's logger, which route each kind of step takes."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.torch_sm70attn")
    logger.addHandler(handler)
    try:
        builder()
    finally:
        logger.removeHandler(handler)
    text = " ".join(r.getMessage() for r in records)
    assert "up to 8 query rows" in text and "paged_attention" in text, text
    assert "prefill" in text and "paged_attention_varlen" in text, text


def test_profile_run_without_metadata():
    """vLLM's profile and warm-up runs: no metadata, output zero, nothing fails."""
    out = torch.full((6, H_Q * D), float("nan"), dtype=torch.float16)
    cache = torch.zeros(4, 2, PS, H_KV, D, dtype=torch.uint8)
    q = torch.randn(6, H_Q, D).half()
    assert impl().forward(SimpleNamespace(), q, None, None, cache, None, output=out) is out
    assert not out.any()


def test_entry_point_registers_the_custom_backend():
    """vLLM loads the plugin through its entry point group; CUSTOM then names our backend."""
    from importlib.metadata import entry_points

    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "torch_sm70attn.integrations.vllm:register" in names, names
    load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.get_class() is backend.SM70AttnBackend


def validate(**kw):
    args = dict(
        head_size=256, dtype=torch.float16, kv_cache_dtype="fp8_e4m3", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(7, 0),
        attn_type="decoder",
    )  # fmt: skip
    args.update(kw)
    return backend.SM70AttnBackend.validate_configuration(**args)


@pytest.mark.parametrize(
    "kw, says",
    [
        ({}, None),
        ({"kv_cache_dtype": "fp8"}, None),
        ({"head_size": 128, "block_size": 32}, None),
        ({"dtype": torch.bfloat16}, "--dtype float16"),
        ({"kv_cache_dtype": "auto"}, "--kv-cache-dtype fp8_e4m3"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "--kv-cache-dtype fp8_e4m3"),
        ({"head_size": 96}, "head size 96"),
        ({"block_size": 8}, "--block-size 16"),
        ({"use_mla": True}, "MLA"),
        ({"has_sink": True}, "sinks"),
        ({"device_capability": DeviceCapability(6, 1)}, "sm_70"),
        ({"attn_type": "encoder_only"}, "encoder_only"),
    ],
)
def test_startup_refusals_name_the_option(kw, says):
    reasons = validate(**kw)
    if says is None:
        assert reasons == []
    else:
        assert any(says in r for r in reasons), reasons


def test_other_vllm_releases_are_refused(monkeypatch):
    assert backend.version_refusal("0.19.1") is None
    assert backend.version_refusal(vllm.__version__) is None  # (0.26: with the opt-in set)
    why = backend.version_refusal("0.21.0")
    assert "0.21.0" in why and "vllm==0.19.1" in why
    # 0.26 (the newer GPUs' torch 2.11) only by the opt-in its GPU runs set
    monkeypatch.delenv(backend.PROXY_ENV, raising=False)
    why = backend.version_refusal("0.26.0")
    assert "not 0.26.0 (0.26 only with TORCH_SM70ATTN_VLLM_PROXY=1, for runs on newer GPUs)" in why
    monkeypatch.setenv(backend.PROXY_ENV, "1")
    assert backend.version_refusal("0.26.0") is None
    assert "0.21.0" in backend.version_refusal("0.21.0")


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"sliding_window": 4096}, "sliding window"),
        ({"alibi_slopes": [1.0] * H_Q}, "ALiBi"),
        ({"logits_soft_cap": 30.0}, "soft-cap"),
        ({"num_kv_heads": 1}, "query heads per KV head"),
        ({"head_size": 80}, "head sizes"),
        ({"kv_cache_dtype": "auto"}, "--kv-cache-dtype fp8_e4m3"),
        ({"attn_type": "encoder_decoder"}, "attention type"),
    ],
)
def test_layer_refusals(kw, says):
    with pytest.raises((ValueError, NotImplementedError), match=says):
        impl(**kw)


def test_max_model_len_beyond_the_contract(monkeypatch):
    """A model whose positions reach past the kernels' contract (vLLM allows it on request)."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.raises(ValueError, match="--max-model-len 262144"):
        builder(vllm_config(max_len=300000))
