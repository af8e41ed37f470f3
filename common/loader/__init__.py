"""HF-format checkpoints: lazy safetensors reads, FP8 / MXFP4 dequantization, nano-vllm style loading, tiny writers."""
from .checkpoint import Checkpoint
from .errors import CheckpointError
from .load import load_weights
from .quant import dequant_fp8_block, dequant_mxfp4, quantize_fp8_block, quantize_mxfp4
from .tokenizer import write_tokenizer
from .writer import save_checkpoint, save_checkpoint_lazily

__all__ = ["Checkpoint", "CheckpointError", "load_weights", "save_checkpoint", "save_checkpoint_lazily", "write_tokenizer",
           "dequant_fp8_block", "dequant_mxfp4", "quantize_fp8_block", "quantize_mxfp4"]
