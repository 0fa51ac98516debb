"""The shipped model's measurement tools on synthetic inputs: acceptance's bookkeeping
(generate and serve count the same steps alike), the repeated-8-gram share, and the loss by
position of train_lm.py and quality.py (which token each band scores)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import acceptance  # noqa: E402
import quality  # noqa: E402
import train_lm  # noqa: E402


def test_early_acceptance_counts_generate_and_serve_alike():
    # two requests, their verify steps emitting (accepted + 1) tokens: request 0 accepts 3, 0,
    # 2; request 1 accepts 1, 1. generate lists the prompts' tokens apart (step 0)...
    generate = [[1, 1], [4, 2], [1, 2], [3, 0]]
    # ... serve in the round of each request's first verify step (request 1 joins a round late)
    serve = [[5, 0], [1, 3], [3, 2]]
    want = (3 + 0 + 2 + 1 + 1) / 5
    assert acceptance.early_acceptance(generate) == want
    assert acceptance.early_acceptance(serve) == want
    # only the steps before a request has emitted `first` tokens count
    assert acceptance.early_acceptance(generate, first=5) == (3 + 1 + 1) / 3


def test_repeated_share():
    prompt = torch.arange(20)
    assert acceptance.repeated_share(prompt, torch.arange(100, 140)) == 0.0
    copy = torch.arange(5, 15)  # copies the prompt: from its 8th token on, 8-grams repeat
    assert acceptance.repeated_share(prompt, copy) == 3 / 10
    loop = torch.tensor([7, 8, 9] * 10) + 100
    share = acceptance.repeated_share(prompt, loop)
    assert share == (30 - 10) / 30  # the loop's 8-grams repeat once it has gone round


def test_loss_by_position_scores_the_tokens_of_each_band():
    T = 64
    # loss[:, p] is the loss of the token at position p + 1: make it that position
    loss = torch.arange(1, T, dtype=torch.float64)[None].repeat(2, 1)
    got = train_lm.by_bucket(loss, 16)
    assert got == {"0-16": sum(range(1, 16)) / 15, "16-32": sum(range(16, 32)) / 16,
                   "32-64": sum(range(32, 64)) / 32}  # fmt: skip
    t = quality.Tally()
    ids = torch.zeros(T, dtype=torch.long)
    logits = torch.zeros(T, 4)  # uniform: every token's NLL is ln 4
    t.add(logits, ids, buckets=[(0, 16), (16, T - 8 + 1), (T - 8 + 1, T)])
    n = {k: v[1] for k, v in t.by_pos.items()}
    assert n == {"0-16": 15, "16-57": 41, "57-64": 7}  # tokens 1..63 once each
    assert sum(n.values()) == T - 1
