"""``tilert draft-vocab``: the most frequent token ids of one's text, the list ``tilert decode --draft-vocab`` takes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tilert.decode.config import read_draft_vocab
from tilert.models.draft_vocab import most_frequent, texts_of


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tilert.cli", "draft-vocab", *args], capture_output=True, text=True, timeout=120
    )


def test_counts_text_and_jsonl_and_writes_what_the_node_reads(tiny_model: Path, tmp_path: Path) -> None:
    """The ids written are the text's most frequent under the checkpoint's tokenizer, most frequent first; the
    JSON Lines records' prompt / completion / text / messages strings are counted, nothing else; the node's
    ``--draft-vocab`` reader takes the file."""
    plain = tmp_path / "a.txt"
    plain.write_text("the cat sat on the mat.\nthe end.\n\nthe")
    logs = tmp_path / "b.jsonl"
    records = [
        {"prompt": "the dog", "completion": " sat", "model": "ignored words here"},
        {"messages": [{"role": "user", "content": "on the mat"}, {"role": "assistant", "content": None}]},
        {"text": "the"},
    ]
    logs.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert list(texts_of(logs)) == ["the dog", " sat", "on the mat", "the"]
    out = tmp_path / "vocab.json"
    done = _cli("--model", str(tiny_model), "--top", "5", "--out", str(out), str(plain), str(logs))
    assert done.returncode == 0, done.stderr
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    counts: Counter[int] = Counter()
    for text in [*plain.read_text().splitlines(keepends=True), "the dog", " sat", "on the mat", "the"]:
        counts.update(tok.encode(text, add_special_tokens=False).ids)
    ids = json.loads(out.read_text())
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert ids == most_frequent(counts, 5, vocab) and len(ids) == min(5, len(counts))
    assert [counts[t] for t in ids] == sorted((counts[t] for t in ids), reverse=True)
    assert read_draft_vocab(str(out), vocab) == tuple(ids)
    assert f"the {len(ids)} most frequent of {sum(counts.values())} tokens" in done.stdout


def test_most_frequent_ranks_by_count_then_id_inside_the_vocabulary() -> None:
    counts = Counter({7: 3, 2: 3, 9: 5, 1: 1, 40: 9})
    assert most_frequent(counts, 3, 10) == [9, 2, 7]  # 40 is outside a 10-token vocabulary
    assert most_frequent(counts, 10, 10) == [9, 2, 7, 1]


def test_refusals_say_why(tiny_model: Path, tmp_path: Path) -> None:
    empty, bad = tmp_path / "empty.txt", tmp_path / "bad.jsonl"
    empty.write_text("")
    bad.write_text('{"prompt": "x"}\n[1, 2]\n')
    out = str(tmp_path / "v.json")
    for args, reason in [
        (["--model", str(tiny_model), "--out", out, str(empty)], "the inputs hold no token"),
        (["--model", str(tiny_model), "--out", out, str(bad)], "bad.jsonl:2: not a JSON object"),
        (["--model", str(tiny_model), "--out", out, "--top", "0", str(empty)], "--top must be >= 1 (0)"),
        (["--model", str(tmp_path), "--out", out, str(empty)], "must hold a config.json with vocab_size"),
        (["--model", str(tiny_model), "--out", out, str(tmp_path / "missing.txt")], "missing.txt"),
    ]:
        done = _cli(*args)
        assert done.returncode == 2 and reason in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_texts_are_counted_a_batch_at_a_time(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of any size count the same: the last, partial one included."""
    from tilert.models import draft_vocab

    texts = ["the cat", "sat on", "the mat", "again and", "again"]
    whole = draft_vocab.count_tokens(tiny_model, texts)
    for size in (1, 2, 3):
        monkeypatch.setattr(draft_vocab, "_BATCH", size)
        assert draft_vocab.count_tokens(tiny_model, iter(texts)) == whole
    assert sum(whole.values()) > len(texts)
