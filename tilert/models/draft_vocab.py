"""``tilert draft-vocab``: the token ids a decode node's MTP drafts may propose (``tilert decode --draft-vocab``),
counted from text one's own traffic holds.

The drafts of a node given such a list read only those rows of the vocabulary head, so the more of the traffic's
tokens the list covers, the more drafts can be accepted; the fewer ids it holds, the fewer bytes a draft reads.
The list is the ``top`` most frequent token ids of the text, most frequent first (ties: the lower id), among the
ids the checkpoint's head has. Inputs: plain text files (read line by line, each line a text), or JSON Lines
(``*.jsonl``) of OpenAI-style records, whose ``prompt``, ``completion``, ``text`` strings and ``messages[].content``
strings are counted. Files are streamed, and texts tokenized a batch at a time: request logs of any size fit.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tilert.models.checkpoint import read_json

__all__ = ["count_tokens", "most_frequent", "texts_of", "write_draft_vocab"]

_FIELDS = ("prompt", "completion", "text")
_BATCH = 1024  # texts tokenized at once


def texts_of(path: Path) -> Iterator[str]:
    """The texts of one input file (see the module docstring); ValueError naming a line that is not a record."""
    with path.open(encoding="utf-8") as f:
        if path.suffix != ".jsonl":
            yield from f
            return
        yield from _records(path, f)


def _records(path: Path, lines: Iterable[str]) -> Iterator[str]:
    """The counted strings of each JSON Lines record of ``path``."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not a JSON record ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        yield from (record[k] for k in _FIELDS if isinstance(record.get(k), str))
        for message in record.get("messages") or []:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                yield message["content"]


def count_tokens(model_dir: Path, texts: Iterable[str]) -> Counter[int]:
    """How often each token id occurs in ``texts`` under the checkpoint's tokenizer (no special tokens added)."""
    from tokenizers import Tokenizer  # lazy: only this command reads text

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    counts: Counter[int] = Counter()
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == _BATCH:
            _count(tok, batch, counts)
            batch = []
    _count(tok, batch, counts)
    return counts


def _count(tok: Any, texts: list[str], counts: Counter[int]) -> None:
    for encoding in tok.encode_batch(texts, add_special_tokens=False):
        counts.update(encoding.ids)


def most_frequent(counts: Counter[int], top: int, vocab_size: int) -> list[int]:
    """The ``top`` most frequent ids below ``vocab_size``, most frequent first, ties to the lower id."""
    ranked = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))
    return ranked[:top]


def write_draft_vocab(model_dir: Path, inputs: list[Path], top: int, out: Path) -> tuple[int, int]:
    """Count ``inputs`` and write the list to ``out``; returns (ids written, tokens counted). ValueError when
    ``top`` < 1, the checkpoint has no tokenizer or vocabulary size, or the inputs hold no token."""
    if top < 1:
        raise ValueError(f"--top must be >= 1 ({top})")
    model_dir = Path(model_dir)
    vocab_size = read_json(model_dir / "config.json").get("vocab_size")
    if not isinstance(vocab_size, int) or not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} must hold a config.json with vocab_size and a tokenizer.json")
    counts = count_tokens(model_dir, (text for path in inputs for text in texts_of(path)))
    ids = most_frequent(counts, top, vocab_size)
    if not ids:
        raise ValueError("the inputs hold no token of the checkpoint's vocabulary")
    out.write_text(json.dumps(ids))
    return len(ids), sum(counts.values())
