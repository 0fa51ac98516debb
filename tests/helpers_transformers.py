"""What the transformers tests share (test_transformers.py and its batch, GPU and tensor-parallel
siblings): the tiny Qwen3 config, stock caches holding what the paged cache holds, a backend
that counts the sm70attn ops of each compiled graph, and the checks for what the CPU's own
kernels do not promise."""

import contextlib
import types

import torch
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3Config

import torch_sm70attn as sa
import torch_sm70attn.reference  # noqa: F401 (E4M3DynamicCache's quantizer)

FP8 = torch.float8_e4m3fn
KS, VS = 0.03, 0.02  # fixed scales, so that the stock path can quantize alike


def tiny(vocab=256, hidden=256, heads=8, head_dim=128, **extra) -> Qwen3Config:
    """A 2-layer Qwen3 config with 2 KV heads (`extra`: more Qwen3Config fields)."""
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=2 * hidden,
        **extra,
    )


class QuantizedDynamicCache(DynamicCache):
    """The stock cache holding what the paged cache holds: e4m3(x / scale) * scale."""

    ks, vs = KS, VS

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def q(x, s):
            return ((x.float() / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)

        k, v = q(key_states, self.ks), q(value_states, self.vs)
        return super().update(k, v, layer_idx, *args, **kwargs)


def counting_backend():
    """The sm70attn backend (AOT-eager on the CPU), and the list it fills: per compiled graph,
    the sm70attn ops it calls."""
    from torch_sm70attn.backend import sm70attn_backend

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sorted(str(n.target) for n in gm.graph.nodes if "sm70attn" in str(n.target)))
        return sm70attn_backend(gm, example_inputs, options={"inner": "aot_eager"})

    torch._dynamo.reset()
    return backend, graphs


def near_tie(tokens, greedy, logits):
    """Checks that `tokens` equal greedy decoding's up to the first step where greedy's logits
    (one [1, vocab] tensor a step) put the other token within 1% of their range of the best, a
    near tie that rounding may break either way; says where that was. (Shared by the GPU
    tests and test_transformers_batch.py.)"""
    n = min(len(tokens), len(greedy))
    diff = (tokens[:n].cpu() != greedy[:n].cpu()).nonzero().flatten().tolist()
    if not diff:
        return "tokens equal"
    i = diff[0]
    step = logits[i][0].float()
    gap = float(step[greedy[i]] - step[tokens[i]])
    spread = float(step.max() - step.min())
    assert 0 <= gap <= 0.01 * spread, (
        f"token {i} differs from greedy's ({int(tokens[i])} for {int(greedy[i])}) where greedy's "
        f"logit is {gap:.3e} above it, over 1% of the logits' range {spread:.3f}: not a near tie"
        f"\n  tokens {tokens.tolist()}\n  greedy {greedy.tolist()}"
    )
    return f"first other token at step {i}: greedy's logit {gap:.2e} above it (range {spread:.1f})"


# --- what the CPU's own kernels do not promise -------------------------------------------------
@contextlib.contextmanager
def rowwise(*models):
    """Every nn.Linear of the models computes one row at a time, one GEMM shape whatever the
    batch and the number of rows, so the models' own forward is batch-invariant on any CPU.
    Without it it is not everywhere: on CPUs with AVX512-FP16 or AMX, oneDNN's float16 GEMMs
    round with the number of rows, so a draft (1 row) and its verify step (1 + k rows) can
    part at a near tie. Tests that hold the library's part bitwise (the cache, the route, the
    acceptance) run under it; the model as it is is held to `near_tie`."""

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= 1:
            return F.linear(x, self.weight, self.bias)
        out = torch.cat([F.linear(r, self.weight, self.bias) for r in rows.split(1)])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    linears = {m for model in models for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for m in linears:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


class E4M3DynamicCache(DynamicCache):
    """transformers' own cache (its own beam reorder, its own concatenation) holding the E4M3
    codes the paged cache stores, [B, H_kv, T, D] float8_e4m3fn a layer; read by `dense`."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def codes(x, s):  # the store's quantizer, [B, H_kv, Q, D] -> codes of the same shape
            return sa.reference.quantize_e4m3(x.transpose(1, 2), torch.tensor(s)).transpose(1, 2)

        k, v = codes(key_states, KS), codes(value_states, VS)
        return super().update(k, v, layer_idx, *args, **kwargs)


def dense(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention over E4M3DynamicCache by the same op as the paged cache's: request b's
    codes as one page of T tokens. No padding (the op's rule alone)."""
    assert attention_mask is None or bool(attention_mask.all()), "dense: no padding"
    B, _, T, _ = key.shape
    table = torch.arange(B, dtype=torch.int32)[:, None]
    lens = torch.full((B,), T, dtype=torch.int32)
    out = sa.paged_attention(
        query, key.transpose(1, 2), value.transpose(1, 2), table, lens, scale=scaling,
        k_scale=KS, v_scale=VS,
    )  # fmt: skip
    return out.transpose(1, 2), None
