"""The model that ships with the package (`torch_sm70attn.model_path()`: a Qwen3-architecture
causal LM trained on Python source by tools/train_lm.py) and text to give it.

    model, tok = shipped.load("cuda")
    ids = shipped.own_source(tok)[: 4096]   # this package's code, which the model never saw

Its documents are laid out as tools/lm_corpus.py lays out the training text: "# package/path",
a newline and the file, then the end-of-text token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import torch_sm70attn as sa

EOT = "<|endoftext|>"


def load(device, path=None, dtype=torch.float16):
    """(model in eval mode on `device`, tokenizer), offline; the attention starts as stock
    sdpa (model.set_attn_implementation("sm70attn") after `register()` for the paged cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .transformers import register

    register()
    path = Path(path or sa.model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {path} (config.json missing): the shipped model comes with the "
            "package's source; pass the folder of another transformers model instead"
        )
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval(), tok


def documents(root: Path, package: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The .py files under root in path order, as the corpus lays them out; files under the
    subfolders `skip`, and files holding the end-of-text token's text, are left out (as
    tools/lm_corpus.py leaves the latter out)."""
    docs = []
    for p in sorted(root.rglob("*.py")):
        if p.relative_to(root).parts[0] in skip:
            continue
        text = p.read_text(encoding="utf-8")
        if EOT not in text:
            docs.append(f"# {package}/{p.relative_to(root.parent).as_posix()}\n{text}")
    return docs


def eot_id(tok) -> int:
    """The id that ends a document: the shipped tokenizer's end-of-text token, another
    tokenizer's eos token."""
    if EOT in tok.get_vocab():
        return tok.convert_tokens_to_ids(EOT)
    if tok.eos_token_id is None:
        raise ValueError("the tokenizer has neither <|endoftext|> nor an eos token")
    return tok.eos_token_id


def own_source(tok) -> torch.Tensor:
    """This package's own .py files as one stream of token ids (1-D int64): Python code written
    after the model's training text was fixed, so held out from it by construction. fx_passes/
    is left out (in a wheel it installs inside the package, in a checkout beside it), so a
    wheel and a checkout give the same stream."""
    root = Path(sa.__file__).parent
    eot = eot_id(tok)
    ids = []
    for doc in documents(root, "torch_sm70attn", skip=("fx_passes",)):
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [eot]
    return torch.tensor(ids, dtype=torch.long)


def file_starts(ids: torch.Tensor, eot: int) -> list[int]:
    """Positions where a document begins in a token stream (0 and after each end-of-text)."""
    after = (ids == eot).nonzero().flatten() + 1
    return [0] + [int(p) for p in after if p < ids.numel()]


def continuations(stream: torch.Tensor, eot: int, ctx: int, n: int, min_file=1536):
    """[n, ctx] prompts: the ctx tokens of the stream that end a third of the way into a file
    of at least min_file tokens (the files before it, then the file's first part), for n files
    spread over the stream (repeated where it has fewer)."""
    starts = file_starts(stream, eot)
    ends = starts[1:] + [stream.numel()]
    every = [s + (e - s) // 3 for s, e in zip(starts, ends, strict=True) if e - s >= min_file]
    cut = [c for c in every if c >= ctx]
    if not cut:
        raise ValueError(
            f"no file of {min_file} tokens or more ends a third in after {ctx} tokens of this "
            f"text ({stream.numel()} tokens): use a shorter context, at most "
            f"{max(every, default=0)} tokens"
        )
    pick = torch.linspace(0, len(cut) - 1, n).long().tolist()
    return torch.stack([stream[cut[i] - ctx : cut[i]] for i in pick])


def token_file(path) -> torch.Tensor:
    """A uint16 token file of tools/lm_corpus.py (heldout.u16; or path + ".xz", compressed)
    as 1-D int64."""
    path = Path(path)
    if path.exists():
        data = np.fromfile(path, dtype=np.uint16)
    else:
        import lzma

        with lzma.open(str(path) + ".xz") as f:
            data = np.frombuffer(f.read(), dtype=np.uint16)
    return torch.from_numpy(data.astype(np.int64))
