"""python -m torch_sm70attn {info,build,demo,check}"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import sys
import time

import torch

import torch_sm70attn as sa

from . import _jit, nvrtc, ops, routes, toolchain
from .manifest import contract


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _route_table(dev: torch.device) -> list[tuple[str, str, str]]:
    """Route of a few typical shapes on this device, and whether the manifest admits them
    on a GPU (tiny tensors: only metadata matters)."""
    cases = [
        ("decode  B1 Q1  G6 D256", 1, 6, 256, torch.float16),
        ("verify  B8 Q8  G6 D256", 8, 6, 256, torch.float16),
        ("verify  B4 Q16 G8 D128", 16, 8, 128, torch.float16),
        ("head dim 96", 1, 6, 96, torch.float16),
        ("group size 12", 1, 12, 128, torch.float16),
        ("bf16 query", 1, 6, 256, torch.bfloat16),
    ]
    rows = []
    for name, q, g, d, dt in cases:
        query = torch.empty(1, g, q, d, dtype=dt, device=dev)
        cache = torch.empty(1, 16, 1, d, dtype=torch.float8_e4m3fn, device=dev)
        a = sa.admit(query, cache)
        rows.append((name, a.route, routes.shape_refusal(query, cache) or "shape admitted"))
    return rows


def info(args) -> int:
    dev = _device()
    print(f"torch_sm70attn {sa.__version__}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        print(f"device: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)")
    else:
        print("device: cpu (no CUDA device visible)")
    print("capability manifest:", json.dumps(sa.capabilities()))
    print(f"contract (no served capacity given): {contract()} tokens")
    dev_reason = routes.admit(
        torch.empty(1, 1, 1, 64, dtype=torch.float16, device=dev),
        torch.empty(1, 1, 1, 64, dtype=torch.float8_e4m3fn, device=dev),
    )
    print(f"routes on this device ({dev_reason.reason}):")
    for name, route, reason in _route_table(dev):
        print(f"  {name:<24} {route:<10} {reason}")
    print(_cuda_status())
    return 0


def _cuda_status() -> str:
    """The toolkit (NVRTC and headers), the binding and the cached kernels, in a few lines."""
    if torch.version.cuda is None:
        return (
            f"CUDA: this torch ({torch.__version__}) is a CPU-only build: every op runs the "
            "reference route, plain PyTorch on the CPU (exact, slow). Nothing is built or "
            "needed for it. The fused kernels need a GPU and a CUDA build of torch "
            "(a V100: torch==2.10.0 and the cuda12 extra)"
        )
    lines = []
    try:
        tk = toolchain.toolkit()
        lines.append(
            f"NVRTC {tk.version[0]}.{tk.version[1]}, CUDA headers in {', '.join(tk.includes)}"
        )
    except RuntimeError as e:
        lines.append(f"NVRTC: {e}")
        tk = None
    try:
        digest = _jit.source_digest()
    except FileNotFoundError as e:
        return "\n".join(lines + [f"CUDA library: {e}"])
    out = _jit.build_dir(digest)
    built = f"built at {out}" if _jit.is_built(digest) else "not built"
    lines.append(f"C++ binding (source digest {digest}): {built}")
    kernels = out / "kernels"
    if tk and kernels.is_dir():
        for d in sorted(kernels.iterdir()):
            n = len(list(d.glob("*.cubin")))
            lines.append(f"kernels cached for {d.name}: {n} of {len(nvrtc.kernels())}")
    return "\n".join(lines)


def _build_archs() -> list[str]:
    """This machine's GPUs' architectures (what the runtime compiles for), then those of
    TORCH_CUDA_ARCH_LIST (for another machine, e.g. sm_70 built on a CPU)."""
    archs = []
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        archs = [nvrtc.arch_of(c) for c in sorted(caps)]
    env = nvrtc.archs_from_env(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    return list(dict.fromkeys(archs + env))


def build(args) -> int:
    archs = _build_archs()
    if not archs:
        print(
            "no CUDA device and no TORCH_CUDA_ARCH_LIST: nothing to build for. For V100s, "
            "TORCH_CUDA_ARCH_LIST=7.0 python -m torch_sm70attn build",
            file=sys.stderr,
        )
        return 1
    status = 0
    if torch.version.cuda is None:
        print(f"C++ binding: not built (torch {torch.__version__} is a CPU-only build)")
    else:
        t0 = time.perf_counter()
        mod = ops.load_cuda_kernels()
        took = time.perf_counter() - t0
        print(f"C++ binding {_jit.module_name(mod.digest())}: {took:.1f} s (host compiler)")
        print(f"at {_jit.build_dir(mod.digest())}")
    for arch in archs:
        t0 = time.perf_counter()

        def progress(i, n, c):
            took = f"{c.seconds:.1f} s" if c.seconds else "cached"
            print(f"[{i:2d}/{n}] {c.arch} {c.kernel.name:<34} {took}", flush=True)

        built = nvrtc.build(arch, args.jobs, progress)
        errors = nvrtc.gate(built)
        print(_kernel_table(built))
        verdict = f"{len(built)} kernels for {arch} in {time.perf_counter() - t0:.0f} s"
        print(f"at {nvrtc.cache_dir(arch)}")
        if arch == "sm_70":  # the V100's rules (SM70 gate)
            for e in errors:
                print(f"ERROR: {e}")
            print(f"{'FAIL' if errors else 'PASS'}: {verdict}, {len(errors)} errors (SM70 gate)")
            status |= bool(errors)
        else:
            print(f"built: {verdict} (the SM70 gate applies to sm_70 only)")
    return status


def _kernel_table(built) -> str:
    cols = ("threads", "regs", "smem_static", "smem_dyn", "stack", "spill_st", "spill_ld")
    head = f"{'kernel':<34}" + "".join(f"{c:>12}" for c in cols)
    rows = [head, "-" * len(head)]
    for c in built:
        rows.append(f"{c.kernel.name:<34}" + "".join(f"{c.info.get(k, 0):>12}" for k in cols))
    return "\n".join(rows)


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_paged_problem(B, H_kv, G, D, page_size, lens, dev, seed=0):
    """Random fp16 K/V stored through store_kv into shuffled pages of an E4M3 cache."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-L // page_size) for L in lens]
    max_pages = max(pages_per_req)
    P = sum(pages_per_req) + 2  # a few pages nobody owns
    perm = torch.randperm(P, generator=gen)
    block_table = torch.zeros(B, max_pages, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages_per_req):
        block_table[b, :n] = perm[i : i + n].int()
        i += n
    key_cache = torch.zeros(P, page_size, H_kv, D, dtype=torch.float8_e4m3fn, device=dev)
    value_cache = torch.zeros_like(key_cache)
    k_scale = torch.rand(H_kv, generator=gen).add(0.5).mul(0.02).to(dev)
    v_scale = torch.rand(H_kv, generator=gen).add(0.5).mul(0.02).to(dev)
    for b, L in enumerate(lens):
        t = torch.arange(L)
        slots = (block_table[b, t // page_size].long() * page_size + t % page_size).to(dev)
        k = torch.randn(L, H_kv, D, generator=gen).half().to(dev)
        v = torch.randn(L, H_kv, D, generator=gen).half().to(dev)
        sa.store_kv(k, v, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return key_cache, value_cache, block_table.to(dev), seq_lens, k_scale, v_scale


def sdpa_over_gather(query, key_cache, value_cache, block_table, seq_lens, k_scale, v_scale):
    """The attention as people write it today: gather pages, convert, scale, SDPA."""
    B, H_q, Q, D = query.shape
    _, page_size, H_kv, _ = key_cache.shape
    dt = query.dtype if query.is_cuda else torch.float32
    ks = k_scale.reshape(-1).expand(H_kv).view(1, 1, H_kv, 1).to(dt)
    vs = v_scale.reshape(-1).expand(H_kv).view(1, 1, H_kv, 1).to(dt)
    k = key_cache[block_table.long()].flatten(1, 2).to(dt) * ks
    v = value_cache[block_table.long()].flatten(1, 2).to(dt) * vs
    k = k.transpose(1, 2).repeat_interleave(H_q // H_kv, dim=1)
    v = v.transpose(1, 2).repeat_interleave(H_q // H_kv, dim=1)
    mask = sa.verifier_mask(seq_lens, Q, k.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(query.to(dt), k, v, attn_mask=mask)
    return out.to(query.dtype)


VERIFY_Q = 8  # query rows of the demo's verify step: the least context it can check


def check(args) -> int:
    dev = args.device or _device()
    B, H_kv, G, D, page = 2, 2, 6, 256, 1648
    lens = [max(args.context - 900, args.context // 2, VERIFY_Q), args.context]
    print(
        f"device {dev}; B={B} H_kv={H_kv} G={G} D={D} page={page} (the seeds' page size, "
        f"whatever the context) seq_lens={lens}"
    )
    kc, vc, bt, sl, ks, vs = make_paged_problem(B, H_kv, G, D, page, lens, dev)
    ok = True
    for Q, what in ((1, "decode"), (VERIFY_Q, "verify")):
        q = torch.randn(B, H_kv * G, Q, D, device=dev).half()
        a = sa.admit(q, kc, bt)
        op = functools.partial(sa.paged_attention, q, kc, vc, bt, sl, k_scale=ks, v_scale=vs)
        ref = functools.partial(sdpa_over_gather, q, kc, vc, bt, sl, ks, vs)
        out, want = op(), ref()
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        t_op, t_ref = _median_ms(op, args.reps), _median_ms(ref, args.reps)
        good = bool(torch.isfinite(out).all()) and err < 2e-3
        ok &= good
        print(
            f"{what:<6} Q={Q:<2} route={a.route:<9} sm70attn {t_op:8.3f} ms | "
            f"gather+SDPA {t_ref:8.3f} ms | rel. error {err:.2e} {'ok' if good else 'MISMATCH'}"
        )
        if a.route != routes.CUDA:
            print(f"       (reference route: {a.reason})")
    return 0 if ok else 1


def _at_least(low: int):
    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


def _demo_device(text: str) -> torch.device:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    dev = torch.device(text)
    if dev.type == "cpu":
        return dev
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch"
    elif not torch.cuda.is_available():
        why = "no GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    elif (dev.index or 0) >= torch.cuda.device_count():
        why = f"only {torch.cuda.device_count()} GPU(s) visible"
    else:
        return dev
    raise argparse.ArgumentTypeError(f"{text} is not available: {why}, or use --device cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_sm70attn", description=__doc__)
    ap.add_argument(
        "--debug", action="store_true", help="a failure's Python traceback, not one message"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, device, manifest, routes, CUDA library status")
    b = sub.add_parser(
        "build",
        help="build the C++ binding and compile every kernel now, for this machine's GPUs and "
        "TORCH_CUDA_ARCH_LIST (no GPU needed with the latter); sm_70 is held to the SM70 gate",
    )
    b.add_argument("--jobs", type=_at_least(1), help="parallel compiles (default: the cores)")
    d = sub.add_parser(
        "demo",
        help="the shipped model (trained on Python) continuing this package's code through the "
        "paged E4M3 cache (prefill, decode, speculative verify) against transformers' stock "
        "float16 path, the text printed (needs the hf extra)",
    )
    d.add_argument("--device", type=_demo_device, help="cpu or cuda (default: cuda if present)")
    d.add_argument(
        "--context",
        type=_at_least(1),
        help="prompt tokens (default: CPU 1024; GPU 32768 less the new tokens and drafts; at "
        "most what the shipped text holds, which a longer one's error says)",
    )
    d.add_argument(
        "--batch", type=_at_least(1), default=1, help="concurrent requests (default: %(default)s)"
    )
    d.add_argument("--model", help="a transformers model folder (default: the shipped model)")
    d.add_argument(
        "--draft",
        type=_at_least(1),
        default=4,
        help="prompt-lookup draft tokens (default: %(default)s)",
    )
    d.add_argument(
        "--new-tokens", type=_at_least(3), help="tokens to generate (default: CPU 32, GPU 64)"
    )
    d.add_argument(
        "--runs",
        type=_at_least(1),
        default=3,
        help="timed runs of each path, after one warm-up run (default: %(default)s)",
    )
    c = sub.add_parser("check", help="one paged decode + verify step, checked against SDPA")
    c.add_argument("--device", type=_demo_device, help="cpu or cuda (default: cuda if present)")
    c.add_argument(
        "--context",
        type=_at_least(VERIFY_Q),
        default=5000,
        help="longest request, tokens (default: %(default)s)",
    )
    c.add_argument(
        "--reps",
        type=_at_least(1),
        default=5,
        help="timed calls of each path, their median reported (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    run = {"info": info, "build": build, "demo": demo, "check": check}[args.cmd]
    if args.debug:
        return run(args)
    try:
        return run(args)
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as e:
        # what a user can fix (a path, a length, a missing package): its message, no traceback
        print(f"{ap.prog} {args.cmd}: error: {e}", file=sys.stderr)
        print(f"(the traceback: python -m torch_sm70attn --debug {args.cmd} ...)", file=sys.stderr)
        return 1


def demo(args) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            f"the demo runs a transformers model: {toolchain.install_hint('hf')} "
            "(or 'python -m torch_sm70attn check' for the op alone)",
            file=sys.stderr,
        )
        return 2
    from .integrations import demo as model_demo

    dev = args.device or _device()
    gpu = dev.type == "cuda"
    new = args.new_tokens or (64 if gpu else 32)
    return model_demo.run(
        dev,
        # on a GPU the shipped model's 32768 trained positions, prompt and new tokens together
        context=args.context or (32768 - new - args.draft if gpu else 1024),
        batch=args.batch,
        draft=args.draft,
        new=new,
        runs=args.runs,
        model=args.model,
    )


if __name__ == "__main__":
    sys.exit(main())
