#!/usr/bin/env python3
"""What a new process pays before its first fast call, on this GPU: loading the binding (built
already, or built now), then the first decode and the first verify call with no kernel compiled
yet (this architecture's cubin cache emptied first), then the same calls again.

    python tools/first_call.py [--json out.json]

The first call of a shape compiles the kernels it needs (its attention kernel and, with several
splits, a combine kernel) with NVRTC and loads them; later shapes that need the same kernels
compile nothing. Seconds, wall clock, each call synchronised.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch

import torch_sm70attn as sa
from torch_sm70attn import _jit, nvrtc, ops, toolchain


def problem(B, Q, ctx, H_kv=1, G=6, D=256, page=1648):
    pages = -(-ctx // page)
    kc = torch.randn(B * pages, page, H_kv, D, device="cuda").to(torch.float8_e4m3fn)
    bt = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    return torch.randn(B, H_kv * G, Q, D, device="cuda").half(), kc, bt, sl


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def first_calls(q, kc, bt, sl) -> dict:
    call = lambda: sa.paged_attention(q, kc, kc, bt, sl)  # noqa: E731
    first, second = timed(call), timed(call)
    B, H_q, Q, D = q.shape
    plan = ops.load_cuda_kernels().plan(B, H_q, kc.shape[2], Q, D, bt.shape[1] * kc.shape[1])
    return dict(first=first, second=second, plan=plan)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.zeros(1, device="cuda")  # the CUDA context, not ours to count
    built = _jit.is_built(_jit.source_digest())
    res = dict(binding_was_built=built, load_binding=timed(ops.load_cuda_kernels))
    arch = nvrtc.device_arch(torch.cuda.current_device())
    shutil.rmtree(nvrtc.cache_dir(arch), ignore_errors=True)
    for name, B, Q, ctx in (("decode B1 Q1 32K", 1, 1, 32768), ("verify B8 Q8 128K", 8, 8, 131072)):
        res[name] = first_calls(*problem(B, Q, ctx))
    res.update(
        arch=arch, nvrtc=".".join(map(str, toolchain.toolkit().version)), torch=torch.__version__
    )
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
