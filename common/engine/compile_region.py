"""`compile_region`: what a model marks as repeated, so that graph mode compiles it once and reuses it at every layer.

A decoder runs the same code at every layer: the attention of each kind of layer, the MoE, DeepSeek-V4's stream
mixing. Traced as one graph, inductor generates code for every layer anew, and its start-up compile grows with the
depth. A function marked `@compile_region` goes through torch.compile's hierarchical compilation
(`torch.compiler.nested_compile_region`; diffusers' regional compilation of a model's `_repeated_blocks` serves
the same end): dynamo traces it at its first call and, at every later call whose inputs match that trace's guards
(shapes, dtypes, the attributes of the module it read, such as a layer's compress ratio), stamps out the subgraph
compiled once; a call that differs (another kind of layer) compiles a variant, up to MAX_VARIANTS of them.
Regions do not nest (dynamo fails on a region inside a region): mark the parts a layer repeats, not the layer and
its parts. Outside torch.compile (eager, NPU, the vLLM plugin) the mark calls the function as it is. A decode
graph that calls regions keeps inductor's Python wrapper (its C++ wrapper has no subgraph call:
graph_runner.compile_decode_graph).

Measure the steps before marking a model: DeepSeek-V4 marks its parts (with a graph per bucket its 7 buckets
compiled in 248 s instead of ~700, estimated); DeepSeek-V3 does not, because its decode graph with the marks ran
slower in bench.py (Xeon, bf16, 2026-12-05: batch 1 / 16 / mixed 43.2 / 344.6 / 373.9 tok/s with them, 59.7 /
398.5 / 442.6 without) and compiled no faster with them (its 7 buckets cold: 105 s with, 95 s without).
"""
from __future__ import annotations

import torch

MAX_VARIANTS = 128  # compiled variants of one region in one graph: every layer a kind of its own still compiles


def compile_region(fn):
    """Mark `fn` (a function, or a module's forward) as a region a graph compiles once per variant."""
    return torch.compiler.nested_compile_region(fn, max_reuse_entries=MAX_VARIANTS)
