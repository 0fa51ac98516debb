"""The shipped model (torch_sm70attn.model_path(), tools/train_lm.py): it loads with no network,
it has learned Python, and the paged E4M3 cache costs it little on code it never saw (this
package's own source): the NLL of the E4M3 path (default scales, a 256-token prompt, then the
fused op 16 rows a forward) stays within a bound of transformers' stock float16 path.
docs/quality.md has the full measurement (tools/quality.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import torch_sm70attn as sa  # noqa: E402
from torch_sm70attn.integrations import shipped  # noqa: E402
from torch_sm70attn.integrations import transformers as hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import quality  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# Measured on reference.py (1491 tokens, 2026-12-03): float16 NLL 2.9615 nats a token, E4M3
# 2.9597 on the CPU and 2.9596 on an H200 (-0.0019: noise of this short text; on the held-out
# split E4M3 costs +0.0006 to +0.0013, docs/quality.md), top-1 agreement 0.973 and 0.975. The
# bounds leave room for other torch versions' rounding and future edits of the file; a model
# that learned nothing scores about ln(8192) = 9.0.
MAX_NLL = 3.5
MAX_DELTA = 0.02
MIN_AGREE = 0.95


def test_loads_offline_with_the_seeds_geometry():
    code = (
        "import torch_sm70attn as sa\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "m = AutoModelForCausalLM.from_pretrained(sa.model_path())\n"
        "t = AutoTokenizer.from_pretrained(sa.model_path())\n"
        "c = m.config\n"
        "print(c.model_type, c.head_dim, c.num_attention_heads, c.num_key_value_heads, "
        "c.vocab_size, m.dtype, t.decode(t('def f(x):\\n    return x')['input_ids']) == "
        "'def f(x):\\n    return x')\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME="/nonexistent")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-7:] == ["qwen3", "256", "12", "2", "8192", "torch.float16", "True"]


@pytest.fixture(scope="module", params=DEVICES)
def loaded(request):
    return shipped.load(torch.device(request.param))


def held_out(tok) -> torch.Tensor:
    """reference.py as the corpus lays out a document: code the model never saw."""
    root = Path(sa.__file__).parent
    doc = next(d for d in shipped.documents(root, "torch_sm70attn") if "/reference.py\n" in d)
    return torch.tensor(tok(doc, add_special_tokens=False)["input_ids"])


def test_e4m3_cache_nll_stays_near_float16(loaded):
    model, tok = loaded
    ids = held_out(tok).to(model.device)
    ref, e4m3 = quality.Tally(), quality.Tally()
    logp = ref.add(quality.stock_logits(model, ids), ids)
    cache = hf.PagedE4M3Cache(model.config, max_tokens=ids.numel() + 64)  # default scales
    logits = quality.paged_logits(model, ids, cache, 256)
    assert logits.shape == (ids.numel(), model.config.vocab_size)
    assert bool(torch.isfinite(logits).all())
    e4m3.add(logits, ids, logp)
    r, e = ref.row(), e4m3.row()
    print(
        f"\nfloat16 NLL {r['nll']:.4f}, E4M3 {e['nll']:.4f}, top-1 agreement {e['top1_agree']:.4f}"
    )
    assert r["nll"] < MAX_NLL, r  # it has learned Python
    assert abs(e["nll"] - r["nll"]) < MAX_DELTA, (r, e)
    assert e["top1_agree"] > MIN_AGREE, e
