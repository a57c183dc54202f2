"""safetensors files read and written one tensor at a time, with bounded memory (the converter's I/O).

Reading: the header is parsed once per file; a tensor is read with one positional read straight into its own
buffer (nothing else of the file is touched). A whole-file memory map is deliberately not used here: every page
of a mapping that has been touched counts as resident until it is unmapped, so streaming a 700 GB checkpoint
through one would report (and, under pressure, hold) the whole file.

Writing: :class:`ShardWriter` writes the header of a shard first (every tensor's dtype and shape, known up
front), then the tensors' bytes at their offsets in any order and in pieces (a stacked expert weight one
expert at a time). The result is a standard safetensors file (``safetensors.safe_open`` reads it, memory-mapped).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets) and what they hold."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of safetensors file ``path``; a truncated or malformed file is refused naming the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: corrupt safetensors header (length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path}: corrupt safetensors header ({exc})") from None
    base = 8 + n
    out: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        shape = tuple(int(d) for d in info["shape"])
        lo, hi = info["data_offsets"]
        if hi - lo != math.prod(shape) * dtype.itemsize or base + hi > size:
            raise ValueError(
                f"{path}: tensor {name} ({info['dtype']} {list(shape)}) does not fit its bytes "
                f"[{lo}, {hi}) of a {size - base}-byte data section (truncated or corrupt file)"
            )
        out[name] = Entry(path, name, dtype, shape, base + lo, base + hi)
    return out


def read_tensor(entry: Entry) -> torch.Tensor:
    """The tensor's bytes, read once into a fresh buffer (its only copy in memory)."""
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        got = f.readinto(buf.numpy().data)
    if got != entry.nbytes:
        raise ValueError(f"{entry.file}: tensor {entry.name} is truncated ({got} of {entry.nbytes} bytes)")
    return buf.view(entry.dtype).reshape(entry.shape)


class ShardWriter:
    """Write one safetensors file: :meth:`write` each tensor (or piece of one) at its place, then :meth:`close`.

    ``specs``: ``name -> (dtype, shape)`` in file order; ``metadata``: the header's ``__metadata__``; ``sync``:
    :meth:`close` waits until the file is on disk (``fsync``), else leaves it to the page cache."""

    def __init__(
        self,
        path: Path,
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        sync: bool = True,
    ) -> None:
        self.path = path
        self.sync = sync
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for name, (dtype, shape) in specs.items():
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self.offsets[name] = (pos, pos + nbytes)
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.base = 8 + len(raw)
        self.written = {name: 0 for name in specs}
        self._f = open(path, "wb")  # noqa: SIM115  (closed by close())
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self.base + pos)

    def write(self, name: str, t: torch.Tensor, offset: int = 0) -> None:
        """Write ``t``'s bytes into tensor ``name`` at byte ``offset`` of it (a piece of a stacked tensor)."""
        lo, hi = self.offsets[name]
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        if lo + offset + data.nbytes > hi:
            raise ValueError(f"{self.path}: {name}: {data.nbytes} bytes at {offset} overrun its {hi - lo} bytes")
        self._f.seek(self.base + lo + offset)
        self._f.write(data.data)
        self.written[name] += data.nbytes

    def close(self) -> None:
        short = [n for n, (lo, hi) in self.offsets.items() if self.written[n] != hi - lo]
        self._f.flush()
        if self.sync:
            os.fsync(self._f.fileno())
        self._f.close()
        if short:
            raise ValueError(f"{self.path}: tensors not completely written: {short[:8]}")
