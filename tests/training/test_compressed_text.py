"""`efla train --data` reads xz-compressed text and JSONL as the files they decompress to, and names a
damaged one. Tiny files, CPU only."""

from __future__ import annotations

import json
import lzma

import pytest

from efla.cli import main
from efla.data.text import check_text_files, expand_paths, read_documents

from .test_train_safety import _one_error_line

BOOK = (
    "The Project Gutenberg eBook of a test\r\n*** START OF THE PROJECT GUTENBERG EBOOK A TEST ***\r\n"
    "It was a dark night; caf\u00e9 lights burned.\r\n\r\nThe end.\r\n*** END OF THE PROJECT GUTENBERG EBOOK A TEST ***\r\n"
    "licence text\r\n"
)
DOCS = ["first document \u2014 with a dash", "second\nspans two lines"]


def _write_xz(path, text: str) -> None:
    path.write_bytes(lzma.compress(text.encode()))


def test_xz_text_and_jsonl_read_as_their_plain_files(tmp_path):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    jsonl = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (plain / "book.txt").write_bytes(BOOK.encode())
    (plain / "docs.jsonl").write_text(jsonl)
    _write_xz(packed / "book.txt.xz", BOOK)
    _write_xz(packed / "docs.jsonl.xz", jsonl)

    expected = list(read_documents([str(plain)]))
    assert expected[0].startswith("It was a dark night") and "licence" not in expected[0]  # stripped, CRLF gone
    assert expected[1:] == DOCS
    assert list(read_documents([str(packed)])) == expected
    assert [p.rsplit("/", 1)[-1] for p in expand_paths([str(packed)])] == ["book.txt.xz", "docs.jsonl.xz"]


def test_xz_of_another_kind_of_file_is_not_taken_from_a_directory(tmp_path):
    _write_xz(tmp_path / "notes.txt.xz", "some text\n")
    _write_xz(tmp_path / "weights.bin.xz", "not text\n")
    assert [p.rsplit("/", 1)[-1] for p in expand_paths([str(tmp_path)])] == ["notes.txt.xz"]


def test_invalid_utf8_inside_xz_is_counted_on_its_line(tmp_path):
    path = tmp_path / "bad.txt.xz"
    path.write_bytes(lzma.compress(b"good line\nsecond line\nbad \xff byte\n"))
    (found,) = check_text_files([str(path)], accept_invalid_utf8=True)
    assert (found.invalid_bytes, found.first_invalid_line) == (1, 3)


@pytest.mark.parametrize("damage", ["truncated", "not xz"])
def test_damaged_xz_is_one_line_naming_the_file(tmp_path, capsys, damage):
    path = tmp_path / "train.txt.xz"
    whole = lzma.compress(("a line of text\n" * 2000).encode())
    path.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else b"plain text, not compressed\n" * 10)
    out = tmp_path / "run"
    args = ["train", "--data", str(path), "--out", str(out), "--vocab-size", "300", "--max-steps", "1", "--no-progress"]
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"efla train: {path}: not a whole xz file") and line.endswith("(--data)"), line
    assert not out.exists()
