"""The reference side of the vision parity test, run in a process of its own: timm 1.0.31's deepseek_vit_412m_enc
(encoder + aligner) on the given vision tensors, over the given images.

`import timm` imports torchvision (FrozenBatchNorm2d for its BatchNorm models, transforms and datasets for its data
pipeline), and PyPI has no torchvision that imports beside the project's CPU torch 2.13 (its build links CUDA
torch). deepseek_vit runs none of that, so where torchvision does not import, this process gives `import timm` a
stand-in package holding the names timm reads at import time (recipes/deepseek/tools/timm_import.py; a separate
process: nothing else sees it).

    python timm_deepseek_vit.py TENSORS.safetensors DIMS.json IMAGES.safetensors OUT.safetensors
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "recipes" / "deepseek" / "tools"))
from timm_import import import_timm  # noqa: E402


def main(tensors_path: str, dims_path: str, images_path: str, out_path: str) -> None:
    timm = import_timm()
    from timm.models.deepseek_vit import checkpoint_filter_fn_encoder

    d = json.loads(open(dims_path).read())
    model = timm.create_model("deepseek_vit_412m_enc", pretrained=False, embed_dim=d["hidden_size"],
                              depth=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
                              mlp_ratio=d["intermediate_size"] / d["hidden_size"],
                              out_features=d["out_hidden_size"]).eval()
    model.load_state_dict(checkpoint_filter_fn_encoder(load_file(tensors_path), model))
    images = load_file(images_path)
    with torch.no_grad():
        out = {name: model(x)[0].contiguous() for name, x in images.items()}  # [ceil(h/3) * ceil(w/3), D]
    save_file(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
