"""Train the shipped model (torch_sm70attn.model_path()): a Qwen3-architecture causal LM from
transformers' own classes, with the seeds' attention geometry (head dim 256, 6 query heads per
KV head, 2 KV heads), on the Python source of tools/lm_corpus.py.

    python tools/lm_corpus.py DATA                     # the text, the tokenizer, the token ids
    python tools/train_lm.py --data DATA --out DIR     # a GPU: bf16 autocast, AdamW
    python tools/train_lm.py --data DATA --out DIR --steps 723 --long-steps 57   # the shipped run

Two phases on one cosine schedule: windows of 4096 tokens, then windows of 32768 (the contexts
the project serves; a model trained at 4K alone is lost past it: RoPE's slow dimensions see
angles they never saw). By default the steps of each phase are set from the measured time of a
few probe steps so that the whole run fits --minutes; the chosen counts are printed and
written to the log, and --steps / --long-steps replay them (the same batches: a replay draws
the probes' batches too, without running them; the GPU's arithmetic is not bitwise the same
run to run). DIR gets the model in float16 (config.json, model.safetensors,
generation_config.json), the tokenizer (DATA's tokenizer.json, with tokenizer_config.json), and
train_log.json: the recipe, the loss curve (training loss every 10 steps, held-out loss every
100), the held-out loss at the end in bf16 and in float16 (4096-token windows, and by position
over 32768-token windows).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from torch_sm70attn.integrations.shipped import token_file

EOT, EOT_ID = "<|endoftext|>", 0  # lm_corpus.EOT, the tokenizer's first special token
CONFIG = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=256,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=EOT_ID,
    pad_token_id=EOT_ID,
)
SHORT, LONG = 4096, 32768


def build(device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**CONFIG)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device), cfg


def loss_of(model, ids: torch.Tensor, reduce: bool = True):
    """Next-token cross entropy of ids [B, T] (mean, or per position [B, T - 1])."""
    logits = model(ids).logits
    loss = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
    )
    return loss.mean() if reduce else loss.view(ids.shape[0], -1)


def windows(data: torch.Tensor, T: int, n: int) -> torch.Tensor:
    """n windows of T tokens, evenly spaced over data [N] (fixed: the same every evaluation)."""
    starts = torch.linspace(0, data.numel() - T - 1, n).long()
    return torch.stack([data[s : s + T] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, wins: torch.Tensor, batch: int, autocast: bool) -> torch.Tensor:
    """Per-position loss [n, T - 1] over the windows."""
    model.eval()
    out = []
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast and wins.is_cuda):
        for i in range(0, wins.shape[0], batch):
            out.append(loss_of(model, wins[i : i + batch], reduce=False))
    model.train()
    return torch.cat(out)


def by_bucket(loss: torch.Tensor, short: int) -> dict[str, float]:
    """Mean loss by position over windows [n, T - 1]: 0 to short, to T / 2, to T (0-4096,
    4096-16384, 16384-32768 for the shipped run)."""
    T = loss.shape[1] + 1
    # position p predicts token p + 1: loss[:, p] is the loss of position p + 1
    cuts = [(0, short), (short, T // 2), (T // 2, T)]
    return {f"{a}-{b}": float(loss[:, max(a - 1, 0) : b - 1].mean()) for a, b in cuts}


def plot(log: Path, png: Path) -> None:
    """The loss curve of a train_log.json: training loss every 10 steps, held-out every 100."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(log.read_text())
    r = d["recipe"]
    tr = np.array(d["curve"]["rows"])
    he = np.array(d["heldout_curve"]["rows"])
    per = r["batch_tokens"] / 1e6
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tr[:, 1] / 1e6, tr[:, 2], lw=1, label="training batch")
    short, long = r["windows"]  # the phases' window lengths (as strings)
    label = f"held-out packages ({short}-token windows)"
    ax.plot((he[:, 0] + 1) * per, he[:, 1], "o-", ms=3, label=label)
    ax.axvline(r["steps"] * per, color="gray", ls=":", lw=1)
    ax.text(r["steps"] * per, ax.get_ylim()[1] * 0.9, f" {long}-token windows", fontsize=8)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss (nats / token)")
    ax.set_ylim(1, 10)
    ax.set_title(f"{r['parameters'] / 1e6:.1f} M parameters, {r['steps'] + r['long_steps']} steps "
                 f"on {r['device']} in {d['train_seconds']:.0f} s", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", type=Path, nargs=2, metavar=("LOG", "PNG"),
                    help="draw a train_log.json's loss curve and exit")  # fmt: skip
    ap.add_argument("--data", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--minutes", type=float, default=6.0, help="training time (probes set steps)")
    ap.add_argument("--long-frac", type=float, default=0.2, help="share of the time at 32768")
    ap.add_argument("--steps", type=int, default=None, help="4096-token steps (replay)")
    ap.add_argument("--long-steps", type=int, default=None, help="32768-token steps (replay)")
    ap.add_argument("--batch-tokens", type=int, default=131072)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs=2, default=[SHORT, LONG],
                    help="the two phases' window lengths (smaller ones: a quick CPU check)")  # fmt: skip
    args = ap.parse_args()
    if args.plot:
        plot(*args.plot)
        return 0
    if args.data is None or args.out is None:
        ap.error("--data and --out are needed to train")
    short, long = args.lengths
    dev = torch.device(args.device)
    t_start = time.perf_counter()
    train = token_file(args.data / "train.u16").to(dev)
    held = token_file(args.data / "heldout.u16").to(dev)
    print(f"tokens: train {train.numel() / 1e6:.2f} M, held-out {held.numel() / 1e6:.2f} M", flush=True)  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = True
    model, cfg = build(dev)
    model.set_attn_implementation("sdpa")
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters", flush=True)
    short_b, long_b = args.batch_tokens // short, max(args.batch_tokens // long, 1)
    gen = torch.Generator(device=dev).manual_seed(0)

    def batch(T: int, B: int) -> torch.Tensor:
        starts = torch.randint(0, train.numel() - T, (B,), generator=gen, device=dev)
        return train[starts[:, None] + torch.arange(T, device=dev)]

    def fwd_bwd(ids):
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            loss = loss_of(model, ids)
        loss.backward()
        return loss

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    steps, long_steps = args.steps, args.long_steps
    probe = {}
    replay = steps is not None and long_steps is not None
    # Probe steps (gradients thrown away) set the step counts; a replay draws the same batches
    # without running them, so that its training batches are the probed run's.
    for T, B, n in ((short, short_b, 4), (long, long_b, 2)):
        if replay:
            for _ in range(n + 1):
                batch(T, B)
            continue
        fwd_bwd(batch(T, B))
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fwd_bwd(batch(T, B))
        sync()
        probe[T] = (time.perf_counter() - t0) / n * 1.03  # + the optimizer step
        model.zero_grad(set_to_none=True)
    if not replay:
        budget = args.minutes * 60
        steps = max(int(budget * (1 - args.long_frac) / probe[short]), 1)
        long_steps = int(budget * args.long_frac / probe[long])
        print(f"probe: {probe[short] * 1e3:.0f} ms a {short}-token step ({short_b} windows), "
              f"{probe[long] * 1e3:.0f} ms a {long}-token step ({long_b}): {steps} + "
              f"{long_steps} steps in {args.minutes} min", flush=True)  # fmt: skip
    total = steps + long_steps
    decay, other = [], []
    for p in model.parameters():
        (decay if p.dim() >= 2 else other).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=dev.type == "cuda",
    )

    def lr_at(i: int) -> float:
        if i < args.warmup:
            return args.lr * (i + 1) / args.warmup
        f = (i - args.warmup) / max(total - args.warmup, 1)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * f)))

    held_short = windows(held, short, args.eval_windows)
    held_long = windows(held, long, 8) if held.numel() > long + 1 else None
    curve, held_curve = [], []
    model.train()
    sync()
    t0 = time.perf_counter()
    for i in range(total):
        T, B = (short, short_b) if i < steps else (long, long_b)
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        loss = fwd_bwd(batch(T, B))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 10 == 0 or i == total - 1:
            curve.append([i, (i + 1) * args.batch_tokens, float(loss.detach()), lr_at(i)])
        if i % 100 == 0 or i == total - 1:
            h = float(evaluate(model, held_short, 8, True).mean())
            el = time.perf_counter() - t0
            held_curve.append([i, h])
            print(f"step {i + 1}/{total} (T={T}): train {float(loss.detach()):.3f}, held-out {h:.3f}, "
                  f"lr {lr_at(i):.2e}, {el:.0f} s, {(i + 1) * args.batch_tokens / el / 1e3:.0f} K tokens/s",
                  flush=True)  # fmt: skip
    sync()
    train_s = time.perf_counter() - t0
    final = {}
    for name, half in (("bf16", False), ("float16", True)):
        if half:
            model.half()
        final[name] = {str(short): float(evaluate(model, held_short, 8, not half).mean())}
        if held_long is not None:
            final[name][str(long)] = by_bucket(evaluate(model, held_long, 1, not half), short)
        print(f"held-out loss ({name}): {json.dumps(final[name])}", flush=True)
    if not math.isfinite(final["float16"][str(short)]):
        raise RuntimeError("the float16 model's held-out loss is not finite")
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = EOT_ID
    model.generation_config.pad_token_id = EOT_ID
    model.save_pretrained(args.out, max_shard_size="1GB")
    if (args.data / "tokenizer.json").exists():  # lm_corpus.py's: the folder loads whole
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(
            tokenizer_file=str(args.data / "tokenizer.json"), eos_token=EOT, pad_token=EOT
        ).save_pretrained(args.out)
    log = {
        "recipe": {
            "config": {k: v for k, v in CONFIG.items()},
            "parameters": params,
            "steps": steps,
            "long_steps": long_steps,
            "batch_tokens": args.batch_tokens,
            "windows": {str(short): short_b, str(long): long_b},
            "lr": args.lr,
            "warmup": args.warmup,
            "schedule": "linear warm-up, cosine to 0.1 x lr over both phases",
            "optimizer": "AdamW betas (0.9, 0.95), weight decay 0.1 on matrices, clip 1.0",
            "precision": "bf16 autocast, float32 weights; saved in float16",
            "probe_s": {str(k): v for k, v in probe.items()},
            "data_tokens": {"train": train.numel(), "heldout": held.numel()},
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
        },
        "train_seconds": train_s,
        "total_seconds": time.perf_counter() - t_start,
        "curve": {"columns": ["step", "tokens", "train_loss", "lr"], "rows": curve},
        "heldout_curve": {"columns": ["step", f"heldout_loss_{short}"], "rows": held_curve},
        "final": final,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"trained {total} steps in {train_s:.0f} s; saved to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
