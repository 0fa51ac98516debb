"""vLLM end to end with this package's backend, through vLLM's own OpenAI server.

    python tools/vllm_e2e.py --out DIR [--steps tokens,spec,stress,bench] [--concurrency 1 4 8]

Needs a GPU, vLLM and this package installed (its entry point registers the CUSTOM backend).
Steps:
- prepare: the shipped model copied to DIR/model with KV-cache scales calibrated on its own
  held-out text (PagedE4M3Cache.calibrate, one per layer: the largest of the KV heads') and
  written into the checkpoint the way vLLM reads them (`model.layers.N.self_attn.k_scale` /
  `v_scale`, with a compressed-tensors quantization_config that quantizes the KV cache only);
- tokens: 8 concurrent greedy requests of different prompt lengths (this package's own source)
  through `--attention-backend CUSTOM --kv-cache-dtype fp8_e4m3`, against vLLM's own TRITON_ATTN
  with the same cache dtype and scales (which also quantizes the query to fp8 on a GPU), against
  this package's transformers adapter over the same scales (the same stored values), and (in the
  bench step) against FLASH_ATTN with a float16 and an fp8 cache: per request the tokens equal
  before the first difference, and the reference's top-2 logprob gap there (a near tie if small);
- spec: the same requests with n-gram speculative decoding (7 drafts), through our verify path:
  tokens against plain decoding, acceptance from the server's /metrics;
- stress: 200 greedy requests of 16 to 32K tokens (log-uniform; half of them sharing prefixes,
  half anywhere in the text) at concurrency 16 through one CUSTOM server with prefix caching,
  1024 tokens a step (every long prompt chunked) and 2100 KV blocks (one 32K request's worth:
  requests are preempted; the server's preemption counter is read), a tenth of them aborted by
  the client after 0.02-0.5 s: no error response, the server alive, and a sample of 8 served
  again alone, tokens against the stressed run's (the gap at a difference);
- bench: `vllm bench serve` (random 32000-token prompts, 128 new tokens, ignore-eos, greedy) at
  each concurrency, our backend against FLASH_ATTN and TRITON_ATTN (what V100 users run today)
  with a float16 cache (served from the shipped folder: the scales' KV scheme would turn vLLM
  0.26's `auto` into fp8), and FLASH_ATTN with an fp8 one (`flash-fp8`, which FA3 refuses for a
  float16 model); `--bench NAME ...` picks the servers.
Where FlashInfer is not installed, run with VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM 0.26's sampler
imports it otherwise).
Each server's log is kept (DIR/server-*.log); whether it captured full CUDA graphs is read from
it. Writes DIR/vllm_e2e.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PORT = 8123
MAX_LEN = 32768
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 7,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
CAPTURE = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128]  # tokens a step: C8 x 8 rows at most


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the model folder ---------------------------------------------------------------------------
def prepare(out: Path) -> Path:
    """The shipped model with per-layer KV scales in its checkpoint, as vLLM reads them."""
    import torch
    from safetensors.torch import load_file, save_file

    import torch_sm70attn as sa
    from torch_sm70attn.integrations import shipped
    from torch_sm70attn.integrations.transformers import PagedE4M3Cache

    folder = out / "model"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(sa.model_path(), folder)
    model, tok = shipped.load("cuda")
    model.set_attn_implementation("sm70attn")
    sample = shipped.own_source(tok)[:4096][None].cuda()
    cache = PagedE4M3Cache(model.config, max_tokens=8192).calibrate(model, sample)
    ks, vs = cache.scales()
    weights = load_file(folder / "model.safetensors")
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        weights[f"model.layers.{i}.self_attn.k_scale"] = k.max().reshape(()).float().cpu()
        weights[f"model.layers.{i}.self_attn.v_scale"] = v.max().reshape(()).float().cpu()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
            "symmetric": True,
        },
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    scales = {"k": [float(k.max()) for k in ks], "v": [float(v.max()) for v in vs]}
    log(f"model with KV scales at {folder}: {scales}")
    del model
    torch.cuda.empty_cache()
    return folder


# --- a server -------------------------------------------------------------------------------------
def _get(path: str, timeout=5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=timeout) as r:
        return r.read().decode()


def _post(path: str, body: dict, timeout=600.0) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def server(out: Path, name: str, model: Path, backend: str, kv_dtype: str, spec=None, extra=()):
    """`vllm serve` in its own process; yields the log's path once /health answers. `extra`:
    more arguments (they follow the defaults, so they override them)."""
    logf = out / f"server-{name}.log"
    os.environ.setdefault("TORCH_SM70ATTN_VLLM_PROXY", "1")  # vLLM 0.26 on a newer GPU
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--port", str(PORT), "--dtype", "float16", "--kv-cache-dtype", kv_dtype,
        "--attention-backend", backend, "--max-model-len", str(MAX_LEN),
        "--gpu-memory-utilization", "0.5", "--max-num-seqs", "16", "--seed", "0",
        "--compilation-config", json.dumps({"cudagraph_capture_sizes": CAPTURE}),
    ]  # fmt: skip
    trained = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    if MAX_LEN > trained:  # a timing row past the trained positions (RoPE extrapolates: the
        # attention's cost is that of any model of this shape; the tokens mean nothing)
        cmd += ["--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN})]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    cmd += list(extra)
    log(f"serve {name}: {' '.join(cmd[3:])}")
    t0 = time.time()
    with open(logf, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server {name} exited ({proc.returncode}):\n" + _tail(logf))
            with contextlib.suppress(OSError):
                if _get("/health", timeout=2) is not None:
                    break
            if time.time() - t0 > 420:
                raise RuntimeError(f"server {name} not up in 420 s:\n" + _tail(logf))
            time.sleep(1)
        log(f"serve {name}: up in {time.time() - t0:.0f} s")
        yield logf
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _tail(path: Path, n=40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def graphs(logf: Path) -> dict:
    """What the server's log says of CUDA graphs and the routes."""
    text = logf.read_text(errors="replace")
    keep = ("cudagraph", "CUDA graph", "Graph capturing", "torch_sm70attn", "CUSTOM", "eager")
    lines = [ln.split("] ", 1)[-1] for ln in text.splitlines() if any(k in ln for k in keep)]
    return {
        "full_graphs_captured": bool(re.search(r"Capturing CUDA graphs \([^)]*FULL", text)),
        "lines": lines[:30],
    }


# --- requests -------------------------------------------------------------------------------------
def prompts(model: Path, lengths: list[int]) -> list[list[int]]:
    """Prompts of these lengths from this package's own source (held out from training)."""
    from transformers import AutoTokenizer

    from torch_sm70attn.integrations import shipped

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    stream = shipped.own_source(tok)
    return [stream[i * 997 : i * 997 + n].tolist() for i, n in enumerate(lengths)]


def completion(model: Path, ids: list[int], new: int, timeout=600.0) -> dict:
    """One greedy completion of `new` tokens: its token ids and top-2 logprobs a step."""
    r = _post("/v1/completions", {
        "model": str(model), "prompt": ids, "max_tokens": new, "temperature": 0, "logprobs": 2,
        "return_tokens_as_token_ids": True, "ignore_eos": True,
    }, timeout=timeout)  # fmt: skip
    lp = r["choices"][0]["logprobs"]
    return {
        "tokens": [int(t.removeprefix("token_id:")) for t in lp["tokens"]],
        "top2": [sorted(d.values(), reverse=True) for d in lp["top_logprobs"]],
    }


def complete(model: Path, ids: list[list[int]], new: int) -> list[dict]:
    """Concurrent greedy completions; per request its token ids and top-2 logprobs a step."""
    results: list[dict | None] = [None] * len(ids)

    def one(i):
        results[i] = completion(model, ids[i], new)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in results):
        raise RuntimeError("a request failed (see the server log)")
    return results


def compare(ours: list[dict], ref: list[dict]) -> list[dict]:
    """Per request: tokens equal before the first difference, and the reference's top-2
    logprob gap at it (a near tie where small)."""
    rows = []
    for a, b in zip(ours, ref, strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True)) if x != y),
            None,
        )
        gap = None
        if n is not None and len(b["top2"][n]) > 1:
            gap = b["top2"][n][0] - b["top2"][n][1]
        rows.append({"equal_prefix": len(a["tokens"]) if n is None else n, "gap": gap})
    return rows


def counters() -> dict[str, float]:
    """The server's /metrics counters, each summed over its labels (a `_total` suffix dropped;
    `_created` timestamps left out)."""
    got: dict[str, float] = {}
    for line in _get("/metrics").splitlines():
        m = re.match(r"^(vllm:\w+?)(?:_total)?(?:\{[^}]*\})? ([0-9.e+]+)$", line)
        if m and not m[1].endswith("_created"):
            got[m[1]] = got.get(m[1], 0.0) + float(m[2])
    return got


def metrics() -> dict:
    """Speculative decoding's counters from the server's /metrics."""
    return {
        k: v for k, v in counters().items()
        if k.startswith("vllm:spec_decode_num_") and "per_pos" not in k
    }  # fmt: skip


def transformers_tokens(model: Path, ids: list[list[int]], new: int, device="cuda") -> list[dict]:
    """The same greedy requests through this package's transformers adapter (eager, a batch
    left padded) over the checkpoint's scales: the same stored values as vLLM's CUSTOM run."""
    import torch
    from transformers import AutoModelForCausalLM

    from torch_sm70attn.integrations import transformers as hf

    hf.register()
    import torch_sm70attn as sa

    # the shipped folder: the same weights, without the quantization_config (transformers would
    # make the checkpoint's scales parameters of its own)
    m = AutoModelForCausalLM.from_pretrained(
        sa.model_path(), dtype=torch.float16, attn_implementation="sm70attn",
        local_files_only=True,
    ).to(device)  # fmt: skip
    ks, vs = hf.kv_scales_from_checkpoint(model)
    longest = max(len(x) for x in ids)
    batch = torch.zeros(len(ids), longest, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, x in enumerate(ids):
        batch[i, longest - len(x) :] = torch.tensor(x)
        mask[i, longest - len(x) :] = 1
    cache = hf.PagedE4M3Cache(
        m.config, max_tokens=len(ids) * (longest + new + 16), max_batch_size=len(ids),
        k_scale=ks, v_scale=vs, reserve=new,
    )  # fmt: skip
    batch, mask = batch.to(device), mask.to(device)
    pos, toks, top = hf.positions(mask), [], []
    with torch.no_grad():  # greedy, eos or not (as vLLM's ignore_eos)
        out = m(batch, attention_mask=mask, position_ids=pos, cache=cache, logits_to_keep=1)
        for _ in range(new):
            lp = out.logits[:, -1].float().log_softmax(-1)
            top.append(lp.topk(2, dim=-1).values)
            toks.append(lp.argmax(-1))
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos[:, -1:] + 1
            out = m(toks[-1][:, None], attention_mask=mask, position_ids=pos, cache=cache)
    top, toks = torch.stack(top, 1).tolist(), torch.stack(toks, 1).tolist()
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return [{"tokens": t, "top2": top[i]} for i, t in enumerate(toks)]


# --- the benchmark -------------------------------------------------------------------------------
# --- stress: the engine's scheduler around our backend -------------------------------------------
STRESS = dict(
    n=200, concurrency=16, new=32, abort_share=0.1, abort_s=(0.02, 0.5), sample=8,
    # every long prompt chunked; few KV blocks (16 tokens each: 2100 hold one 32K request, so
    # 16 at once are preempted)
    args=["--max-num-batched-tokens", "1024", "--num-gpu-blocks-override", "2100",
          "--enable-prefix-caching"],
)  # fmt: skip


def stress_requests(model: Path, n: int, seed=0) -> list[list[int]]:
    """n prompts of 16 to 32K tokens (log-uniform), stretches of this package's source: the
    even ones start at one of 8 offsets (prompts of one offset share a prefix, which prefix
    caching serves as a chunk over a cached past), the odd ones anywhere (their own blocks:
    the KV demand that preempts)."""
    import random

    from transformers import AutoTokenizer

    from torch_sm70attn.integrations import shipped

    rng = random.Random(seed)
    stream = shipped.own_source(AutoTokenizer.from_pretrained(model, local_files_only=True))
    top = min(MAX_LEN - STRESS["new"] - 64, len(stream) - 8000)
    out = []
    for i in range(n):
        length = int(math.exp(rng.uniform(math.log(16), math.log(top))))
        start = rng.randrange(8) * 1000 if i % 2 == 0 else rng.randrange(len(stream) - length)
        out.append(stream[start : start + length].tolist())
    return out


def stress(model: Path, seed=0) -> dict:
    """STRESS["n"] greedy requests at STRESS["concurrency"] through one server; a share of them
    aborted by the client (its connection closed after STRESS["abort_s"]); every other one must
    answer 200 with its tokens. Then a sample of the finished ones again, each alone: tokens
    against the stressed run's, with the top-2 logprob gap at the first difference."""
    import random
    import socket
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    ids = stress_requests(model, STRESS["n"], seed)
    aborts = {i for i in range(len(ids)) if rng.random() < STRESS["abort_share"]}
    waits = {i: rng.uniform(*STRESS["abort_s"]) for i in aborts}
    results: list = [None] * len(ids)

    def one(i):
        try:
            return i, completion(model, ids[i], STRESS["new"], timeout=waits.get(i, 900.0))
        except (socket.timeout, TimeoutError):
            return i, "aborted"
        except urllib.error.HTTPError as e:
            return i, f"HTTP {e.code}: {e.read()[:300]!r}"
        except OSError as e:
            if i in aborts:
                return i, "aborted"
            return i, f"error: {e!r}"

    t0 = time.time()
    with ThreadPoolExecutor(STRESS["concurrency"]) as pool:
        for i, r in pool.map(one, range(len(ids))):
            results[i] = r
    wall = time.time() - t0
    errors = {i: r for i, r in enumerate(results) if isinstance(r, str) and r != "aborted"}
    finished = [i for i, r in enumerate(results) if isinstance(r, dict)]
    alive = _get("/health", timeout=5) is not None
    preempted = counters().get("vllm:num_preemptions", 0.0)
    sample = rng.sample(finished, min(STRESS["sample"], len(finished)))
    alone = {}
    for i in sample:  # one at a time: each alone in the engine
        _, r = one(i)
        alone[i] = r
    rows = [
        {"request": i, "prompt_len": len(ids[i]), **compare([results[i]], [alone[i]])[0]}
        for i in sample
        if isinstance(alone[i], dict)
    ]
    return {
        "config": {k: v for k, v in STRESS.items()},
        "requests": len(ids), "aborted_by_client": sorted(i for i in aborts if results[i] == "aborted"),
        "finished": len(finished), "errors": errors, "server_alive": alive, "wall_s": wall,
        "preemptions": preempted,
        "prompt_tokens": sum(map(len, ids)), "longest": max(map(len, ids)),
        "sample_vs_alone": rows,
    }  # fmt: skip


def log_counts(logf: Path) -> dict:
    """What the server's log says happened under stress: preemptions, prefix-cache hits, errors."""
    text = logf.read_text(errors="replace")
    hit = re.findall(r"[Pp]refix cache hit rate: ([0-9.]+)%", text)
    return {
        "preempted_lines": len(re.findall(r"[Pp]reempt", text)),
        "prefix_cache_hit_rate_last": float(hit[-1]) if hit else None,
        "error_lines": [ln for ln in text.splitlines() if "ERROR" in ln or "Traceback" in ln][:20],
    }


def bench_input_len(new: int) -> int:
    """A bench prompt's tokens: the servers' length less the new tokens and 640 of headroom."""
    return MAX_LEN - new - 640


def bench(out: Path, model: Path, name: str, concurrency: list[int], new: int) -> list[dict]:
    rows, input_len = [], bench_input_len(new)
    for c in concurrency:
        f = f"bench-{name}-c{c}.json"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "vllm", "--base-url", f"http://127.0.0.1:{PORT}", "--model", str(model),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(new), "--num-prompts", str(max(2 * c, 4)),
            "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0", "--seed", "0",
            "--save-result",
            "--result-dir", str(out), "--result-filename", f,
        ]  # fmt: skip
        log(f"bench {name} C{c}")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        r = json.loads((out / f).read_text())
        keep = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "median_itl_ms")
        rows.append({"backend": name, "concurrency": c, "input_len": input_len,
                     **{k: r.get(k) for k in keep}})
        log(f"  {rows[-1]}")
    return rows


def main() -> int:
    global MAX_LEN
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", default="tokens,spec,bench")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--new", type=int, default=48, help="new tokens a request (tokens, spec)")
    ap.add_argument("--bench-new", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=MAX_LEN,
                    help="the servers' --max-model-len (bench prompts: this less 768 tokens); past "
                    "the model's positions only as a timing row")
    ap.add_argument("--bench", nargs="+", default=["custom-fp8", "flash-fp16", "triton-fp16"])
    ap.add_argument("--lengths", type=int, nargs="+",
                    default=[37, 300, 1200, 2500, 6000, 11000, 20000, 30000])  # fmt: skip
    a = ap.parse_args()
    MAX_LEN = a.max_len
    a.out.mkdir(parents=True, exist_ok=True)
    steps = a.steps.split(",")
    result_file = a.out / "vllm_e2e.json"
    res = json.loads(result_file.read_text()) if result_file.exists() else {}
    model = a.out / "model"
    if not (model / "config.json").exists():
        model = prepare(a.out)
    ids = prompts(model, a.lengths)

    def save():
        result_file.write_text(json.dumps(res, indent=1))

    ours = None
    if "custom" in res.get("tokens", {}):  # an earlier call's run of the same requests
        ours = [{"tokens": t} for t in res["tokens"]["custom"]]
    if "tokens" in steps or "spec" in steps:
        with server(a.out, "custom", model, "CUSTOM", "fp8_e4m3") as logf:
            ours = complete(model, ids, a.new)
            res["custom_graphs"] = graphs(logf)
        with server(a.out, "triton", model, "TRITON_ATTN", "fp8_e4m3") as logf:
            ref = complete(model, ids, a.new)
        res["tokens"] = {"lengths": a.lengths, "new": a.new, "vs_triton": compare(ours, ref)}
        log(f"tokens vs TRITON_ATTN fp8: {res['tokens']['vs_triton']}")
        res["tokens"]["vs_transformers"] = compare(ours, transformers_tokens(model, ids, a.new))
        log(f"tokens vs the transformers adapter: {res['tokens']['vs_transformers']}")
        res["tokens"]["custom"] = [r["tokens"] for r in ours]
        save()
    if "spec" in steps:
        with server(a.out, "custom-spec", model, "CUSTOM", "fp8_e4m3", SPEC) as logf:
            spec = complete(model, ids, a.new)
            res["spec"] = {"config": SPEC, "metrics": metrics(), "vs_plain": compare(spec, ours)}
            res["spec_graphs"] = graphs(logf)
        log(f"spec: {res['spec']}")
        save()
    if "stress" in steps:
        with server(a.out, "custom-stress", model, "CUSTOM", "fp8_e4m3", extra=STRESS["args"]) as logf:
            res["stress"] = stress(model)
        res["stress"]["log"] = log_counts(logf)
        log(f"stress: {json.dumps(res['stress'])[:2000]}")
        save()
    if "bench" in steps:
        import torch_sm70attn as sa

        # kept: earlier rows of other servers, or of these at another prompt length
        input_len = bench_input_len(a.bench_new)
        rows = [r for r in res.get("bench", [])
                if r["backend"] not in a.bench or r.get("input_len", 32000) != input_len]
        for name, backend, kv in (
            ("custom-fp8", "CUSTOM", "fp8_e4m3"),
            ("flash-fp16", "FLASH_ATTN", "auto"),  # the shipped folder: no KV scheme, fp16
            ("triton-fp16", "TRITON_ATTN", "auto"),  # what V100 users run today
            ("flash-fp8", "FLASH_ATTN", "fp8_e4m3"),
        ):
            if name not in a.bench:
                continue
            folder = sa.model_path() if kv == "auto" else model
            with server(a.out, name, folder, backend, kv) as logf:
                if name != "custom-fp8" and ours is not None:
                    res["tokens"][f"vs_{name}"] = compare(ours, complete(folder, ids, a.new))
                    log(f"tokens vs {name}: {res['tokens'][f'vs_{name}']}")
                res[f"{name}_graphs"] = graphs(logf)
                rows += bench(a.out, folder, name, a.concurrency, a.bench_new)
            res["bench"] = rows
            save()
    save()
    log(f"wrote {result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
