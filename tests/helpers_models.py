"""A toy decoder built from the idioms the FX rewrites accept (HF's repeat_kv, vLLM's slot
assignment into the cache), and that decoder with its paged caches as buffers, served one step
at a time: shared by the tests of the rewrites, of the serving loop and of CUDA graphs."""

import torch
import torch.nn.functional as F

import torch_sm70attn as sa

FP8 = torch.float8_e4m3fn
# The served toy's geometry: layers, KV heads, head dim, query heads per KV head, page size,
# pages, model dim.
LAYERS, H, D, G, PS, P, DIM = 2, 2, 64, 2, 16, 64, 64


# --- idioms the rewrites accept (tests/test_fx_passes.py), the decoder's parts -----------------
def repeat_kv(x, n):
    """HF transformers' repeat_kv."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def q8(x, s):
    return (x.float() / s).clamp(-448, 448).to(FP8)


def write_slots(k, v, kc, vc, slots, ks, vs):
    """vLLM-style slot assignment into a [slots, H, D] view."""
    H, D = kc.shape[2:]
    kc.view(-1, H, D)[slots] = q8(k, ks)
    vc.view(-1, H, D)[slots] = q8(v, vs)


# --- a toy decoder through the real backend ----------------------------------------------------
class Layer(torch.nn.Module):
    def __init__(self, dim, H, D, G):
        super().__init__()
        self.H, self.D, self.G = H, D, G
        self.qkv = torch.nn.Linear(dim, (H * G + 2 * H) * D, bias=False)
        self.o = torch.nn.Linear(H * G * D, dim, bias=False)
        self.register_buffer("k_scale", torch.tensor(0.05))
        self.register_buffer("v_scale", torch.tensor(0.04))

    def forward(self, x, kc, vc, bt, sl, slots):
        B, Q, _ = x.shape
        H, D, G = self.H, self.D, self.G
        q, k, v = self.qkv(x).view(B, Q, H * (G + 2), D).split([H * G, H, H], dim=2)
        write_slots(
            k.reshape(B * Q, H, D),
            v.reshape(B * Q, H, D),
            kc,
            vc,
            slots,
            self.k_scale,
            self.v_scale,
        )
        kk = (kc[bt].flatten(1, 2).half() * self.k_scale).transpose(1, 2)
        vv = (vc[bt].flatten(1, 2).half() * self.v_scale).transpose(1, 2)
        mask = sa.verifier_mask(sl, Q, kk.shape[2])
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), repeat_kv(kk, G), repeat_kv(vv, G), attn_mask=mask
        )
        return x + self.o(a.transpose(1, 2).reshape(B, Q, H * G * D))


class Decoder(torch.nn.Module):
    def __init__(self, layers=2, dim=64, H=2, D=64, G=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(dim, H, D, G) for _ in range(layers))

    def forward(self, x, caches, bt, sl, slots):
        for layer, (kc, vc) in zip(self.layers, caches, strict=True):
            x = layer(x, kc, vc, bt, sl, slots)
        return x


# --- the toy decoder served: its caches as buffers, one step's inputs --------------------------
class Served(torch.nn.Module):
    """The toy decoder (Decoder) with its paged caches as buffers."""

    def __init__(self, layers=LAYERS, dim=DIM, H=H, D=D, G=G, P=P, ps=PS):
        super().__init__()
        self.dec = Decoder(layers=layers, dim=dim, H=H, D=D, G=G).half()  # before the fp8 caches
        for i in range(layers):
            for kv in "kv":
                self.register_buffer(f"{kv}{i}", (torch.randn(P, ps, H, D) * 8).to(FP8))

    def forward(self, x, bt, sl, slots):
        caches = [
            (getattr(self, f"k{i}"), getattr(self, f"v{i}")) for i in range(len(self.dec.layers))
        ]
        return self.dec(x, caches, bt, sl, slots)


def step_inputs(B, W, Q, gen, dim=DIM, ps=PS, P=P):
    """One step: disjoint shuffled pages (the last page kept free, so that eager writes of
    padding slot -1 land there), lengths in [Q, capacity], the slots of the Q new tokens."""
    bt = torch.randperm(P - 1, generator=gen)[: B * W].view(B, W).int()
    sl = torch.randint(Q, W * ps + 1, (B,), generator=gen).int()
    pos = sl[:, None] - Q + torch.arange(Q)
    slots = (bt.gather(1, (pos // ps).long()) * ps + pos % ps).long()
    x = torch.randn(B, Q, dim, generator=gen).half()
    return x, bt, sl, slots
