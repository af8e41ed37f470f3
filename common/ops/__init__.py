"""Fused ops for modeling code: `from common import ops`, then `ops.rms_norm(x, weight, eps)` and so on.

Every op has one pure-PyTorch reference (`reference/`: the ground truth on CPU) and an NPU implementation
(`npu.py`) that calls the real torch_npu op. The backend is chosen once, at import: "npu" when
common.backend.is_npu(), else "reference". `use_backend` switches all ops at once; tests use it to run the NPU
implementations against `emulator.TorchNpuEmulator`, an emulation of the torch_npu ops (their real schemas and
documented semantics) on CPU, which is not a run on hardware.
"""
from __future__ import annotations

from common import backend

from . import npu, reference
from .reference import (  # the reference backend; use_backend() rebinds these names
    add_rms_norm,
    apply_attention_sinks,
    attention,
    causal_conv1d,
    causal_conv1d_update,
    chunk_kda,
    dynamic_quant,
    grouped_matmul,
    grouped_quant_matmul,
    hstu_attention,
    lightning_indexer,
    merge_attention_states,
    moe_finalize_routing,
    moe_gating_topk,
    moe_init_routing,
    paged_attention,
    quant_linear,
    recurrent_kda,
    reshape_and_cache,
    rms_norm,
    rotary_emb,
    sparse_attention,
    swiglu,
)

OPS = tuple(reference.__all__)
_backend = "reference"


def use_backend(name: str, torch_npu_module=None) -> str:
    """Point every op at backend `name` ("reference" or "npu"); returns the previous backend's name.

    For "npu", `torch_npu_module` stands in for torch_npu (tests pass the emulator); by default the real import.
    """
    global _backend
    if name == "npu":
        module = torch_npu_module or backend.torch_npu()
        if module is None:
            raise RuntimeError("torch_npu does not import here: pass torch_npu_module (e.g. the emulator)")
        npu.torch_npu, impls = module, npu
    elif name == "reference":
        impls = reference
    else:
        raise ValueError(f"unknown ops backend {name!r}: expected 'reference' or 'npu'")
    globals().update({op: getattr(impls, op) for op in OPS})
    previous, _backend = _backend, name
    return previous


def backend_name() -> str:
    return _backend


use_backend("npu" if backend.is_npu() else "reference")
