"""Fixtures of the common tests."""
import pytest

from common import ops
from common.ops.emulator import TorchNpuEmulator


@pytest.fixture
def emu():
    """The NPU implementations of common.ops over the torch_npu emulator, for one test."""
    emulator = TorchNpuEmulator()
    previous = ops.use_backend("npu", emulator)
    yield emulator
    ops.use_backend(previous)
