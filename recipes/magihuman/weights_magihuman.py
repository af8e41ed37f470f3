"""Load a MagiHuman DiT folder (base/, distill/, 540p_sr/, 1080p_sr/) in the publisher's tensor names.

The module tree uses the publisher's names, so no rename is needed: the blocks' linears are bf16; norms (w, i.e.
gamma - 1), embedders (with bias) and the two heads fp32 (a checkpoint's tensors are cast to these on load); `adapter.rope.bands` may be absent (then recomputed from the config).
"""
from __future__ import annotations

from pathlib import Path

import torch

from common.loader import CheckpointError, load_weights
from config_magihuman import MagiHumanConfig
from modeling_magihuman import MagiHumanDiT
from rope_magihuman import rope_bands


def build_dit(config: MagiHumanConfig, device="cpu", dtype=torch.bfloat16) -> MagiHumanDiT:
    """An uninitialised DiT on `device` (no random init of 15B parameters), RoPE bands filled."""
    with torch.device("meta"):
        model = MagiHumanDiT(config, dtype)
    model.to_empty(device=device)
    bands = model.adapter.rope.bands
    bands.copy_(rope_bands(config.rope_bands, config.rope_theta))
    bands.optional = True
    return model.eval()


def load_dit(path, device="cpu", dtype=torch.bfloat16) -> MagiHumanDiT:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such DiT folder")
    try:
        config = MagiHumanConfig.from_folder(path)
    except (AssertionError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    model = build_dit(config, device, dtype)
    load_weights(model, path)
    return model
