"""Localise run-to-run differences of the fused step (layer-v32 dims, 1 layer): which buffer first differs."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import torch

import fused_model as fm
from tilert.engines.tilert.ops import triton_pdl

dev = torch.device("cuda")
order = ["h", "a", "b", "q", "iq", "iw", "scores", "idx", "olat", "o", "part", "ids", "wts", "act", "logits"]
for cfg in (fm.small_cfg(fm.LAYER_V32, 1),):
    model = fm.FusedDecoder(cfg, 3000, dev)
    tok = torch.tensor([11], device=dev)
    for sparse, p in ((False, 1500), (True, 2650)):
        pos = torch.tensor([p], device=dev)
        for pdl in (True, False):
            triton_pdl.set_enabled(pdl)
            snaps = []
            for _ in range(3):
                model.forward(tok, pos, sparse)
                torch.cuda.synchronize()
                b = model.bufs(1)
                snaps.append({k: b[k].clone() for k in order if k in b})
            diffs = []
            for k in order:
                if k in snaps[0]:
                    d = max(float((snaps[j][k].float() - snaps[0][k].float()).abs().max()) for j in (1, 2))
                    diffs.append(f"{k}={d:.2e}")
            print(f"{cfg.name} sparse={sparse} pdl={pdl}: " + " ".join(diffs), flush=True)
    triton_pdl.set_enabled(True)
