"""The connector's copy out of vLLM's paged caches on a GPU: the Triton kernel against the reference, then its cost.

For each of vLLM's GPU layouts the connector stages (``fp8_ds_mla`` and the DSA indexer's block-major pages of
V3.2, bf16 dense MLA), caches of one layout for ``--layers`` layers with random bytes, a shuffled block table, and
prompts of each ``--tokens`` length:

- **check**: :meth:`tilert.connector.gather.LayerGroup.copy` on the GPU (one kernel a run of layers) into pinned host
  memory and into device memory, against the reference (per layer, ``take_rows`` then a copy), byte for byte; whole
  runs and a run that starts inside the group;
- **cost**: the host time to queue a request's copies of every layer (what lands in the forward: the copy is
  asynchronous), per layer as the reference does and in one launch, and the GPU time of the copy itself.

    python3 benchmarks/check_connector_gather.py                         (H200)
    python3 benchmarks/check_connector_gather.py --out DIR               also DIR/connector-gather.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tilert.connector.gather import LayerGroup, RequestRows

LAYOUTS = {  # group, kind, row bytes, one layer's cache for num_blocks blocks of block_size tokens
    "fp8_ds_mla": ("mla", 656, lambda nb, bs: torch.randint(0, 256, (nb, bs, 656), dtype=torch.uint8)),
    "dsa_indexer": ("indexer", 132, lambda nb, bs: torch.randint(0, 256, (nb, bs, 132), dtype=torch.uint8)),
    "mla_dense": ("mla", 1152, lambda nb, bs: torch.randn(nb, bs, 576).to(torch.bfloat16)),
}


def _groups(kind: str, layers: int, num_blocks: int, block_size: int) -> tuple[LayerGroup, LayerGroup]:
    """One group's caches on the GPU, copied by the kernel and by the reference."""
    group, row, make = LAYOUTS[kind]
    caches = [make(num_blocks, block_size).cuda() for _ in range(layers)]
    fast = LayerGroup(group, kind, row, caches)
    assert fast.on_gpu_kernel, f"{kind}: the GPU group took the reference"
    return fast, LayerGroup(group, kind, row, caches, kernel=False)


def _host_us(fn, repeats: int) -> tuple[float, float]:
    """Median host microseconds to queue ``fn`` and the GPU microseconds it then takes."""
    host, gpu = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(1e6 * (time.perf_counter() - t0))
        end.record()
        torch.cuda.synchronize()
        gpu.append(1000 * start.elapsed_time(end))
    return sorted(host)[len(host) // 2], sorted(gpu)[len(gpu) // 2]


def _per_layer(group: LayerGroup, rows: RequestRows, dst: torch.Tensor, layers: int) -> None:
    """A request's copies as the connector queued them before: a layer at a time, an event each."""
    rows.index.clear()
    for layer in range(layers):
        group.copy(rows, dst, layer, 1)
        torch.cuda.Event().record()


def _one_launch(group: LayerGroup, rows: RequestRows, dst: torch.Tensor, layers: int) -> None:
    group.copy(rows, dst, 0, layers)
    torch.cuda.Event().record()


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
    rows_out, failures = [], 0
    print(
        f"{'layout':<12} {'tokens':>6} {'check':>6} {'ref host us':>11} {'kernel host us':>14} "
        f"{'ref gpu us':>10} {'kernel gpu us':>13} {'kernel GB/s':>11}"
    )
    for kind in LAYOUTS:
        fast, ref = _groups(kind, layers, num_blocks, bs)
        row = fast.row_bytes
        for n in tokens:
            table = torch.randperm(num_blocks, generator=gen)[: -(-n // bs)].tolist()
            want = torch.empty(layers, n, row, dtype=torch.uint8, pin_memory=True)
            ref.copy(RequestRows(table, n, bs, torch.device("cuda")), want, 0, layers)
            torch.cuda.synchronize()
            ok = True
            pinned = torch.empty(want.shape, dtype=torch.uint8, pin_memory=True)
            for dst in (pinned, torch.empty_like(want, device="cuda")):
                dst.fill_(0)
                rows = RequestRows(table, n, bs, torch.device("cuda"))
                first = layers // 3
                fast.copy(rows, dst, 0, first)  # two runs: the second starts inside the group
                fast.copy(rows, dst, first, layers - first)
                torch.cuda.synchronize()
                ok &= torch.equal(dst.cpu(), want)
            failures += not ok

            rows = RequestRows(table, n, bs, torch.device("cuda"))
            ref_host, ref_gpu = _host_us(lambda: _per_layer(ref, rows, want, layers), args.repeats)  # noqa: B023
            k_host, k_gpu = _host_us(lambda: _one_launch(fast, rows, want, layers), args.repeats)  # noqa: B023
            gbs = layers * n * row / (k_gpu * 1e3)
            print(
                f"{kind:<12} {n:>6} {'PASS' if ok else 'FAIL':>6} {ref_host:>11.0f} {k_host:>14.0f} "
                f"{ref_gpu:>10.0f} {k_gpu:>13.0f} {gbs:>11.1f}"
            )
            rows_out.append(
                {
                    "layout": kind,
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
        out = Path(args.out) / "connector-gather.json"
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows_out}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
