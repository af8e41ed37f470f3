"""Ops of the npu_cookbook namespace registered straight with the dispatcher, as vLLM's
`direct_register_custom_op`: torch.library.custom_op wraps every call in Python (autograd and schema handling),
~12 us a call on the Xeon of the deepseek recipe's BENCHMARKS.md (a packed [384, 1024] linear at one row: 34.6 us
through it, 22.6 us called directly, 24.7 us registered here), and a compiled CPU decode step makes ~60 such calls
(every packed linear, paged decode attention, the experts). Inference only: the kernel has no autograd formula."""
from __future__ import annotations

import torch

_LIB = torch.library.Library("npu_cookbook", "FRAGMENT")  # kept alive here: the registrations live as long as it


def direct_register_custom_op(name: str, kernel, fake, dispatch_key: str = "CompositeExplicitAutograd") -> None:
    """Define npu_cookbook::<name> with the schema torch infers from `kernel`'s annotations (it mutates nothing and
    returns new tensors), `kernel` as its implementation for every backend and `fake` for its output shapes (what
    torch.compile traces)."""
    _LIB.define(name + torch.library.infer_schema(kernel, mutates_args=()))
    _LIB.impl(name, kernel, dispatch_key)
    torch.library.register_fake(f"npu_cookbook::{name}", lib=_LIB)(fake)
