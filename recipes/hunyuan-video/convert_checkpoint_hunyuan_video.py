"""Convert the publisher's HunyuanVideo `ckpts/` folder (torch pickles) into the safetensors layout this recipe loads.

The publisher ships the DiT as `hunyuan-video-t2v-720p/transformers/mp_rank_00_model_states.pt` (a dict whose
"module" entry is the state dict; "ema" in some releases) with its config in code (HYVideo-T/2-cfgdistill), and the
VAE as `hunyuan-video-t2v-720p/vae/pytorch_model.pt` (+ config.json). This writes, beside them, `config.json` (the
DiT's: HYVideo-T/2-cfgdistill unless one is there already) +
`model-*.safetensors` (+ index) into the same folders, with the publisher's tensor names unchanged; the text
encoder folders (`text_encoder/`, `text_encoder_2/`) are transformers folders already and are left alone.

    python recipes/hunyuan-video/convert_checkpoint_hunyuan_video.py /data/HunyuanVideo/ckpts

The pickles are opened with torch.load(weights_only=True, mmap=True): tensors only, no code runs, pages are read
as they are written out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from common.loader import save_checkpoint
from config_hunyuan_video import MODEL_DIR, HunyuanVideoConfig

SHARD_BYTES = 5 * 1024**3


def _state_dict(path: Path, key: str | None) -> dict[str, torch.Tensor]:
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for k in ([key] if key else ["module", "ema", "state_dict"]):
        if isinstance(obj, dict) and isinstance(obj.get(k), dict):
            return obj[k]
    if key:
        raise KeyError(f"{path}: no {key!r} entry (has {sorted(obj)[:5]})")
    return obj


def convert(ckpts: Path, key: str | None = None) -> None:
    dit = ckpts / MODEL_DIR / "transformers"
    state = _state_dict(dit / "mp_rank_00_model_states.pt", key)
    config = json.loads((dit / "config.json").read_text()) if (dit / "config.json").is_file() \
        else HunyuanVideoConfig().to_dict()  # the publisher's HYVideo-T/2-cfgdistill
    save_checkpoint(dit, state, config, max_shard_bytes=SHARD_BYTES)
    vae = ckpts / MODEL_DIR / "vae"
    state = _state_dict(vae / "pytorch_model.pt", None)
    state = {k.removeprefix("vae."): v for k, v in state.items()}
    config = json.loads((vae / "config.json").read_text())
    save_checkpoint(vae, state, config, max_shard_bytes=SHARD_BYTES)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpts", type=Path, help="the publisher's ckpts/ folder")
    p.add_argument("--key", choices=("module", "ema"), help="which state dict of the DiT pickle (default: module)")
    a = p.parse_args(argv)
    try:
        convert(a.ckpts, a.key)
    except (OSError, KeyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted {a.ckpts / MODEL_DIR}: transformers/ and vae/ now hold safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
