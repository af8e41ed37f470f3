"""The pipeline's models by stage, and the offload switch of the upstream Ascend recipe for 64 GB cards.

Without offload every model is loaded onto the compute device once and stays. With offload only the stage being
run is resident: entering a stage parks whatever else is on the device, leaving it parks the stage's own model.
Parking on an accelerator moves the weights to host memory (`.to("cpu")`) and back on the next use; when the
compute device is the CPU itself the model is released instead (weights freed) and read from its files again.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from common import backend


class StageModels:
    def __init__(self, loaders: dict[str, Callable[[torch.device], nn.Module]], device: torch.device, offload: bool):
        self.loaders, self.device, self.offload = loaders, torch.device(device), offload
        self.models: dict[str, nn.Module | None] = dict.fromkeys(loaders)
        self.load_seconds = 0.0  # loads, moves and frees of models, summed
        self.history: list[tuple[str, list[str]]] = []  # (stage, models resident on the device while it ran)

    def _on_device(self, name: str) -> bool:
        model = self.models[name]
        if model is None:
            return False
        p = next(model.parameters())
        return p.device == self.device or (self.device.type != "cpu" and p.device.type == self.device.type)

    def resident(self) -> list[str]:
        return [name for name in self.models if self._on_device(name)]

    def _bring(self, name: str) -> nn.Module:
        start = time.perf_counter()
        if self.models[name] is None:
            self.models[name] = self.loaders[name](self.device)
        elif not self._on_device(name):
            self.models[name].to(self.device)
        backend.synchronize()
        self.load_seconds += time.perf_counter() - start
        return self.models[name]

    def _park(self, name: str) -> None:
        if not self._on_device(name):
            return
        start = time.perf_counter()
        if self.device.type == "cpu":
            self.models[name] = None  # no slower memory to park in: free it (refcount), reload from files next time
        else:
            self.models[name].to("cpu")
        backend.empty_cache()
        backend.synchronize()
        self.load_seconds += time.perf_counter() - start

    def load_all(self, names) -> None:
        for name in names:
            self._bring(name)

    @contextmanager
    def use(self, name: str):
        """The stage's model on the compute device for the duration of the block."""
        if self.offload:
            for other in self.models:
                if other != name:
                    self._park(other)
        model = self._bring(name)
        self.history.append((name, self.resident()))
        try:
            yield model
        finally:
            if self.offload:
                self._park(name)
