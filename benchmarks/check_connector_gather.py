"""The connector's copy out of vLLM's paged caches on a GPU: the Triton kernel against the reference, then its cost.

For each set of caches the connector stages from vLLM's GPU layouts (DeepSeek-V3.2: ``fp8_ds_mla`` pages and the
DSA indexer's pages, one of each a layer; bf16 dense MLA pages), ``--layers`` layers with random bytes, a shuffled
block table, and prompts of each ``--tokens`` length:

- **check**: :meth:`tilert.connector.gather.KVCopier.copy` on the GPU (one kernel a run of items) into pinned host
  memory and into device memory, against the reference (per cache layer, ``take_rows`` then a copy), byte for byte;
  in two runs, the second starting inside the extent;
- **cost**: the host time to queue a request's copies of every layer (what lands in the forward: the copy is
  asynchronous), a layer at a time as the reference does and in one launch, and the GPU time of the copy itself.

    python3 benchmarks/check_connector_gather.py                         (H200)
    python3 benchmarks/check_connector_gather.py --out DIR               also DIR/connector-gather.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tilert.connector.gather import Group, KVCopier, RequestRows

CACHES: dict[str, list[tuple[str, str, int, Callable[[int, int], torch.Tensor]]]] = {
    "v32": [
        ("mla", "fp8_ds_mla", 656, lambda nb, bs: torch.randint(0, 256, (nb, bs, 656), dtype=torch.uint8)),
        ("indexer", "dsa_indexer", 132, lambda nb, bs: torch.randint(0, 256, (nb, bs, 132), dtype=torch.uint8)),
    ],
    "bf16": [("mla", "mla_dense", 1152, lambda nb, bs: torch.randn(nb, bs, 576).to(torch.bfloat16))],
}


def _copiers(name: str, layers: int, num_blocks: int, block_size: int) -> tuple[KVCopier, KVCopier]:
    """One set of caches on the GPU, copied by the kernel and by the reference."""
    groups = [
        Group(g, kind, row, [make(num_blocks, block_size).cuda() for _ in range(layers)])
        for g, kind, row, make in CACHES[name]
    ]
    fast = KVCopier(groups)
    assert fast.on_gpu_kernel, f"{name}: the GPU copier took the reference"
    return fast, KVCopier(groups, kernel=False)


def _host_us(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median host microseconds to queue ``fn`` and the GPU microseconds it then takes (what it returns, the host
    memory its copy reads, is kept until then)."""
    host, gpu = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        keep = fn()
        host.append(1e6 * (time.perf_counter() - t0))
        end.record()
        torch.cuda.synchronize()
        del keep
        gpu.append(1000 * start.elapsed_time(end))
    return sorted(host)[len(host) // 2], sorted(gpu)[len(gpu) // 2]


def _per_item(copier: KVCopier, table: list[int], n: int, bs: int, extent: torch.Tensor) -> None:
    """A request's copies as the connector queued them a layer at a time: an event each."""
    rows = RequestRows(table, n, bs, torch.device("cuda"))
    for item in range(len(copier.items)):
        copier.copy(rows, extent, item, 1)
        torch.cuda.Event().record()


def _one_launch(copier: KVCopier, table: list[int], n: int, bs: int, extent: torch.Tensor) -> object:
    keep = copier.copy(RequestRows(table, n, bs, torch.device("cuda")), extent, 0, len(copier.items))
    torch.cuda.Event().record()
    return keep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--tokens", default="1,77,1024,8192,32768")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    bs, layers = args.block_size, args.layers
    num_blocks = 2 * max(tokens) // bs + 8
    gen = torch.Generator().manual_seed(0)
    out, failures = [], 0
    print(
        f"{'caches':<6} {'tokens':>6} {'check':>6} {'ref host us':>11} {'kernel host us':>14} "
        f"{'ref gpu us':>10} {'kernel gpu us':>13} {'kernel GB/s':>11}"
    )
    for name in CACHES:
        fast, ref = _copiers(name, layers, num_blocks, bs)
        per_token = sum(g.row_bytes * len(g.caches) for g in fast.groups)
        for n in tokens:
            table = torch.randperm(num_blocks, generator=gen)[: -(-n // bs)].tolist()
            want = torch.empty(n * per_token, dtype=torch.uint8, pin_memory=True)
            ref.copy(RequestRows(table, n, bs, torch.device("cuda")), want, 0, len(ref.items))
            torch.cuda.synchronize()
            ok = True
            pinned = torch.empty(want.shape, dtype=torch.uint8, pin_memory=True)
            for dst in (pinned, torch.empty_like(want, device="cuda")):
                dst.fill_(0)
                rows = RequestRows(table, n, bs, torch.device("cuda"))
                split = len(fast.items) // 3
                keep = [fast.copy(rows, dst, 0, split), fast.copy(rows, dst, split, len(fast.items) - split)]
                torch.cuda.synchronize()
                del keep
                ok &= torch.equal(dst.cpu(), want)
            failures += not ok
            ref_host, ref_gpu = _host_us(lambda: _per_item(ref, table, n, bs, want), args.repeats)  # noqa: B023
            k_host, k_gpu = _host_us(lambda: _one_launch(fast, table, n, bs, want), args.repeats)  # noqa: B023
            gbs = n * per_token / (k_gpu * 1e3)
            print(
                f"{name:<6} {n:>6} {'PASS' if ok else 'FAIL':>6} {ref_host:>11.0f} {k_host:>14.0f} "
                f"{ref_gpu:>10.0f} {k_gpu:>13.0f} {gbs:>11.1f}"
            )
            out.append(
                {
                    "caches": name,
                    "layers": layers,
                    "tokens": n,
                    "block_size": bs,
                    "ok": ok,
                    "reference_host_us": ref_host,
                    "kernel_host_us": k_host,
                    "reference_gpu_us": ref_gpu,
                    "kernel_gpu_us": k_gpu,
                    "kernel_gb_s": gbs,
                }
            )
    print("ALL PASS" if not failures else f"{failures} FAILED")
    if args.out:
        doc = {"device": torch.cuda.get_device_name(), "rows": out}
        (Path(args.out) / "connector-gather.json").write_text(json.dumps(doc, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
