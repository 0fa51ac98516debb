"""A CUDA graph emulated on the CPU, for the tests of the backend's recorder
(torch_sm70attn/cudagraphs.py) and of the models recorded through it."""

import torch

from torch_sm70attn import cudagraphs


class FakeGraph:
    """A CUDA graph's semantics on the CPU: capture runs nothing (fn runs on scratch copies to
    get output buffers of the right shapes); replay runs fn on the tensors it was recorded
    with (a real graph keeps their addresses) and writes the results into those buffers."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, list(args)
        scratch = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        self.out = fn(*scratch)

    def replay(self):
        for buf, new in zip(self.out, self.fn(*self.args), strict=True):
            buf.copy_(new)

    def pool(self):
        return None


def emulated(monkeypatch, fail=False):
    """The recorder on the CPU, each capture a FakeGraph (fail: each capture raises CUDA's error
    for a refused capture instead), until monkeypatch undoes it."""
    monkeypatch.setattr(cudagraphs, "DEVICE", "cpu")

    def capture(fn, args, pool):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        g = FakeGraph(fn, args)
        return g, g.out

    monkeypatch.setattr(cudagraphs, "_capture", capture)
