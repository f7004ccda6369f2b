"""The data of the language-model claim on corpus-large, made small enough to carry to a lent GPU
(git-ignored, default ``.devdata/lm/``; ``scripts/lm_large.sh`` trains and evaluates on it):

* ``train.jsonl.xz``: the first ``--train-mb`` MB of text of ``corpus-large/train-00.txt.xz``;
* ``valid.jsonl.xz``: about ``--valid-mb`` MB of ``corpus-large/valid.txt.xz`` (the held-out
  authors), every k-th section so that every author's books are in it, not only the first author's;
* ``wiki.valid.raw``, ``wiki.test.raw`` (WikiText-2) and ``lambada_test.jsonl``, copied;
* ``tokenizer/``: a byte-level BPE of ``--vocab-size`` tokens trained on the first
  ``--tokenizer-chars`` characters of the training text, the one tokenizer of every model;
* ``manifest.json``: the sources' and every file's size and SHA-256, the settings, and the tokens
  of the training and validation text under that tokenizer.

A document (one JSON line) is a section of the text: the corpus separates books by two blank lines,
and some books use two blank lines between their own sections too, so a book can be several
documents (an end-of-text token between them). The same sources and options give the same bytes.

    python scripts/prep_lm_large.py                                  # ../shared/data -> .devdata/lm
    python scripts/prep_lm_large.py --check .devdata/lm              # the files against the manifest
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import sys
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the repository's efla, also in a checkout without install

SECTION_BREAK = "\n\n\n"
COPIED = {"wiki.valid.raw": "wikitext-2-raw", "wiki.test.raw": "wikitext-2-raw", "lambada_test.jsonl": "lambada"}
MB = 1_000_000


class PrepError(Exception):
    """A user's mistake: a missing source, an output directory that is not ours, a damaged file."""


def sections(text_stream, chunk_chars: int = 1 << 22) -> Iterator[str]:
    """The non-empty sections of a text read from ``text_stream``, split at two blank lines."""
    pending = ""
    while chunk := text_stream.read(chunk_chars):
        pending += chunk
        *done, pending = pending.split(SECTION_BREAK)
        yield from (s.strip("\n") for s in done if s.strip())
    if pending.strip():
        yield pending.strip("\n")


def first_sections(path: str, text_bytes: int) -> list[str]:
    """Sections from the start of the xz text file ``path`` until they hold ``text_bytes`` bytes."""
    taken, size = [], 0
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for section in sections(f):
            if size >= text_bytes:
                break
            taken.append(section)
            size += len(section.encode())
    return taken


def spread_sections(path: str, text_bytes: int) -> list[str]:
    """Every k-th section of the xz text file ``path`` (k from the file's size, so the choice spans
    the whole file), until they hold ``text_bytes`` bytes."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        every = list(sections(f))
    total = sum(len(s.encode()) for s in every)
    stride = max(1, total // max(1, text_bytes))
    taken, size = [], 0
    for section in every[::stride]:
        if size >= text_bytes:
            break
        taken.append(section)
        size += len(section.encode())
    return taken


def jsonl_xz(documents: list[str]) -> bytes:
    lines = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in documents)
    return lzma.compress(lines.encode(), preset=9)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def file_entry(path: str) -> dict:
    return dict(bytes=os.path.getsize(path), sha256=sha256_of(path))


def claim_out_dir(out: str) -> None:
    """``out`` is new, empty, or made by this script (it has our manifest); anything else is refused."""
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise PrepError(f"{out}: exists and is not a directory (--out)")
    manifest = os.path.join(out, "manifest.json")
    if os.listdir(out) and not os.path.isfile(manifest):
        raise PrepError(f"{out}: not empty and not made by this script (no manifest.json); choose another --out (--out)")


def check_sources(shared: str) -> dict:
    """The source files under ``shared`` (corpus-large, WikiText-2 raw, LAMBADA), each checked to exist."""
    wanted = {"train-00.txt.xz": "corpus-large", "valid.txt.xz": "corpus-large", **COPIED}
    found = {}
    for name, folder in wanted.items():
        path = os.path.join(shared, folder, name)
        if not os.path.isfile(path):
            raise PrepError(f"{path}: no such file (--shared)")
        found[name] = path
    return found


def train_tokenizer(documents: list[str], vocab_size: int, chars: int, save_dir: str):
    from efla.data.tokenizer import train_bpe_tokenizer

    def texts():
        budget = chars
        for d in documents:
            if budget <= 0:
                return
            yield d[:budget]
            budget -= len(d)

    return train_bpe_tokenizer(texts(), vocab_size=vocab_size, save_dir=save_dir)


def count_tokens(documents: list[str], tokenizer) -> int:
    """Tokens of ``documents`` as ``efla train`` packs them (each document followed by eos)."""
    from efla.data.text import tokenize_documents

    return int(len(tokenize_documents(documents, tokenizer, tokenizer.eos_token_id)))


def prepare(args) -> dict:
    from efla import records  # lazy: efla imports torch, which --check does without

    sources = check_sources(args.shared)
    claim_out_dir(args.out)
    os.makedirs(args.out, exist_ok=True)
    train = first_sections(sources["train-00.txt.xz"], int(args.train_mb * MB))
    valid = spread_sections(sources["valid.txt.xz"], int(args.valid_mb * MB))
    files = {}
    for name, docs in (("train.jsonl.xz", train), ("valid.jsonl.xz", valid)):
        path = os.path.join(args.out, name)
        records.atomic_write_bytes(path, jsonl_xz(docs))
        files[name] = dict(file_entry(path), documents=len(docs), text_bytes=sum(len(d.encode()) for d in docs))
    for name in COPIED:
        path = os.path.join(args.out, name)
        shutil.copyfile(sources[name], path + ".tmp")
        os.replace(path + ".tmp", path)
        files[name] = file_entry(path)
    tok_dir = os.path.join(args.out, "tokenizer")
    shutil.rmtree(tok_dir, ignore_errors=True)
    tokenizer = train_tokenizer(train, args.vocab_size, args.tokenizer_chars, tok_dir)
    for name in sorted(os.listdir(tok_dir)):
        files[f"tokenizer/{name}"] = file_entry(os.path.join(tok_dir, name))
    files["train.jsonl.xz"]["tokens"] = count_tokens(train, tokenizer)
    files["valid.jsonl.xz"]["tokens"] = count_tokens(valid, tokenizer)
    manifest = dict(
        made_by="scripts/prep_lm_large.py",
        settings=dict(
            train_mb=args.train_mb, valid_mb=args.valid_mb, vocab_size=args.vocab_size, tokenizer_chars=args.tokenizer_chars
        ),
        versions=records.versions("tokenizers"),
        sources={name: dict(file_entry(path), path=os.path.relpath(path, args.shared)) for name, path in sources.items()},
        files=files,
    )
    records.atomic_write_json(os.path.join(args.out, "manifest.json"), manifest, indent=1)
    return manifest


def check(out: str) -> dict:
    """The manifest of ``out``, every file of it checked against its size and SHA-256."""
    path = os.path.join(out, "manifest.json")
    if not os.path.isfile(path):
        raise PrepError(f"{path}: no such file; make the data first with scripts/prep_lm_large.py (--check)")
    with open(path) as f:
        manifest = json.load(f)
    for name, entry in manifest["files"].items():
        file = os.path.join(out, name)
        if not os.path.isfile(file):
            raise PrepError(f"{file}: missing, the manifest lists it (--check)")
        if file_entry(file) != dict(bytes=entry["bytes"], sha256=entry["sha256"]):
            raise PrepError(f"{file}: differs from the manifest (size or SHA-256) (--check)")
    return manifest


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=os.path.join(REPO, "..", "shared", "data"), help="the shared data folder")
    p.add_argument("--out", default=os.path.join(REPO, ".devdata", "lm"), help="output folder (default: .devdata/lm)")
    p.add_argument("--train-mb", type=float, default=100.0, help="MB of training text (default: %(default)s)")
    p.add_argument("--valid-mb", type=float, default=2.0, help="MB of held-out text (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary (default: %(default)s)")
    p.add_argument(
        "--tokenizer-chars", type=int, default=20_000_000, help="characters the BPE is trained on (default: %(default)s)"
    )
    p.add_argument("--check", metavar="DIR", help="only check DIR's files against its manifest.json")
    args = p.parse_args(argv)
    for option in ("train_mb", "valid_mb"):
        if getattr(args, option) <= 0:
            p.exit(2, f"prep_lm_large.py: expected a positive number of MB (--{option.replace('_', '-')})\n")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.check:
            manifest = check(args.check)
            print(f"{args.check}: {len(manifest['files'])} files match manifest.json")
            return 0
        manifest = prepare(args)
    except PrepError as e:
        print(f"prep_lm_large.py: {e}", file=sys.stderr)
        return 2
    for name, entry in manifest["files"].items():
        extra = f", {entry['tokens']:,} tokens" if "tokens" in entry else ""
        print(f"{name}: {entry['bytes']:,} bytes{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
