"""The README's programs run as written: the whole-model example, whose compile path rewrote
every layer of every graph it compiled (no refusal, no warning), and the transformers one."""

import logging
import re
from pathlib import Path

import pytest
import torch
from oracle import rel_err
from torch._dynamo.utils import counters

README = Path(__file__).resolve().parents[1] / "README.md"


def example(heading: str = "### A whole model") -> str:
    """The first Python block after `heading`."""
    text = README.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_model_example_runs_as_written(capsys, caplog):
    torch._dynamo.reset()
    counters.clear()
    ns = {"__name__": "readme_example"}
    with caplog.at_level(logging.WARNING, logger="torch_sm70attn"):
        exec(compile(example(), str(README), "exec"), ns)
    printed = capsys.readouterr().out
    graphs = counters["stats"]["unique_graphs"]
    c = counters["sm70attn"]
    assert graphs >= 2  # a decode and a verify graph at least
    assert c["paged_attention_rewrite"] == 2 * graphs and not c.get("sdpa_refused"), dict(c)
    assert c["store_kv_rewrite"] == 2 * graphs and not c.get("store_refused"), dict(c)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "paged_attention_rewrite" in printed
    # the comment on the print says what it prints (it said 2 and 2 where it printed 6 and 6)
    said = re.search(r"# (\d+) graphs .*: (\d+), (\d+)\n", example())
    rewrites = (graphs, c["paged_attention_rewrite"], c["store_kv_rewrite"])
    assert said and rewrites == tuple(map(int, said.groups())), (said, rewrites)
    logits = ns["logits"]
    assert logits.shape == (2, 4, 512) and torch.isfinite(logits.float()).all()
    # The last (verify) step again, eagerly: it rewrites the same slots (eager's slot -1 lands
    # in the pool's last page, which no request owns) and must give the same logits.
    x, bt, sl, B = (ns[k] for k in ("x", "bt", "sl", "B"))
    with torch.no_grad():
        want = ns["model"](x, bt, sl, ns["slots_of"](bt, sl, 4))[:B]
    assert rel_err(logits, want.double()) < 1e-2
    print(f"{graphs} graphs", dict(c))


def test_readme_transformers_example_runs_as_written(capsys):
    """It used torch, AutoModelForCausalLM, name, tokenizer, prompts and sample_ids without
    defining them: now a whole program on the shipped model, two prompts of different lengths
    (left padding), 32 new tokens each, printed; the cache is empty at its end."""
    pytest.importorskip("transformers")
    ns = {"__name__": "readme_transformers"}
    exec(compile(example("## With Hugging Face transformers"), str(README), "exec"), ns)
    printed = capsys.readouterr().out
    out, batch, tok = ns["out"], ns["batch"], ns["tokenizer"]
    T = batch.input_ids.shape[1]
    assert out.shape == (2, T + 32)
    assert sorted(batch.attention_mask[:, 0].tolist()) == [0, 1]  # one of them left padded
    for text in tok.batch_decode(out[:, T:]):
        assert text in printed
    assert ns["cache"].get_seq_length() == 0 and ns["cache"].scales()[0][0] is not None
