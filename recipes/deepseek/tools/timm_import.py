"""timm, the vision tower's reference, where PyPI's torchvision cannot load beside this CPU torch.

`import timm` (1.0.31) imports torchvision (FrozenBatchNorm2d for its BatchNorm models, transforms and datasets for
its data pipeline), and PyPI has no torchvision that imports beside the project's CPU torch 2.13 (its build links
CUDA torch). deepseek_vit runs none of that, so where torchvision does not import, `import_timm` gives `import timm`
a stand-in package holding the names timm reads at import time. Only for processes that run timm as a reference
(bench_vision.py, the parity test's own process): it changes sys.modules for the process.
"""
import enum
import sys
import types

import torch


def import_timm():
    """The timm module, with the torchvision stand-in installed first where torchvision does not import."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or a CUDA build that cannot load here
        install_torchvision_standin()
    import timm
    return timm


def install_torchvision_standin() -> None:
    class InterpolationMode(enum.Enum):
        NEAREST, NEAREST_EXACT, BILINEAR = "nearest", "nearest-exact", "bilinear"
        BICUBIC, BOX, HAMMING, LANCZOS = "bicubic", "box", "hamming", "lanczos"

    def stand_in(attr: str):  # a class timm names at import time and never builds
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    def package(name: str, **names) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(names)
        module.__getattr__ = stand_in
        sys.modules[name] = module
        return module

    functional = package("torchvision.transforms.functional", InterpolationMode=InterpolationMode)
    misc = package("torchvision.ops.misc", FrozenBatchNorm2d=type("FrozenBatchNorm2d", (torch.nn.Module,), {}))
    package("torchvision", ops=package("torchvision.ops", misc=misc), datasets=package("torchvision.datasets"),
            transforms=package("torchvision.transforms", functional=functional,
                               InterpolationMode=InterpolationMode))
