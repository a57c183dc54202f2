"""Tensor names and shapes of a transformers model as its checkpoint stores them (experts one by one)."""

from __future__ import annotations

from typing import Any


def checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """``model``'s state dict (a meta-device model will do) with transformers' fused expert tensors
    (``mlp.experts.gate_up_proj`` / ``down_proj``) split into the per-expert ``gate_proj`` / ``up_proj`` /
    ``down_proj`` weights the released checkpoints hold."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            e, two_i, d = t.shape
            for j in range(e):
                for proj in ("gate_proj", "up_proj"):
                    shapes[name.replace("gate_up_proj", f"{j}.{proj}.weight")] = (two_i // 2, d)
        elif name.endswith("mlp.experts.down_proj"):
            for j in range(t.shape[0]):
                shapes[name.replace("down_proj", f"{j}.down_proj.weight")] = tuple(t.shape[1:])
        else:
            shapes[name] = tuple(t.shape)
    return shapes
