"""Pure-PyTorch references of the fused ops: the ground truth on CPU, one function per op."""
from .attention import (
    apply_attention_sinks,
    attention,
    merge_attention_states,
    paged_attention,
    reshape_and_cache,
    sparse_attention,
)
from .hstu import hstu_attention
from .indexer import lightning_indexer
from .kda import causal_conv1d, causal_conv1d_update, chunk_kda, recurrent_kda
from .moe import grouped_matmul, moe_finalize_routing, moe_gating_topk, moe_init_routing, swiglu
from .norm import add_rms_norm, rms_norm
from .quant import dynamic_quant, grouped_quant_matmul, quant_linear
from .rope import rotary_emb

__all__ = [
    "rms_norm",
    "add_rms_norm",
    "rotary_emb",
    "attention",
    "paged_attention",
    "reshape_and_cache",
    "sparse_attention",
    "merge_attention_states",
    "apply_attention_sinks",
    "lightning_indexer",
    "moe_gating_topk",
    "moe_init_routing",
    "moe_finalize_routing",
    "grouped_matmul",
    "swiglu",
    "hstu_attention",
    "dynamic_quant",
    "quant_linear",
    "grouped_quant_matmul",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_kda",
    "recurrent_kda",
]
