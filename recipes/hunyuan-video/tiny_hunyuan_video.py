"""Write a tiny random HunyuanVideo checkpoint in the publisher's folder layout (fixed seed).

    <root>/hunyuan-video-t2v-720p/transformers/   DiT: config.json + safetensors, publisher names
    <root>/hunyuan-video-t2v-720p/vae/            3D causal VAE: config.json + safetensors, publisher names
    <root>/text_encoder/                          Llama-architecture LLM + its tokenizer (transformers folder)
    <root>/text_encoder_2/                        CLIP-L text tower + its tokenizer (transformers folder)

    python recipes/hunyuan-video/tiny_hunyuan_video.py weights/hunyuan-video-tiny
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

from common.loader import write_tokenizer
from config_hunyuan_video import MODEL_DIR
from vae_hunyuan_video import write_tiny_vae
from weights_hunyuan_video import write_tiny_transformer

LLM_SPECIAL = {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|finetune_right_pad_id|>",
               "start_header": "<|start_header_id|>", "end_header": "<|end_header_id|>", "eot": "<|eot_id|>"}
CLIP_SPECIAL = {"bos": "<|startoftext|>", "eos": "<|endoftext|>"}
LLM_HIDDEN, CLIP_HIDDEN, VOCAB = 32, 16, 512


def write_tiny_text_encoders(root: Path, seed: int = 0) -> None:
    """A 3-layer Llama (hidden 32) and a 2-layer CLIP text tower (hidden 16), each with an offline BPE tokenizer."""
    torch.manual_seed(seed)
    llm = LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=LLM_HIDDEN, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                 bos_token_id=0, eos_token_id=1, pad_token_id=2))
    llm.save_pretrained(root / "text_encoder")
    write_tokenizer(root / "text_encoder", VOCAB, LLM_SPECIAL, chat_template="", model_max_length=1024)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=CLIP_HIDDEN, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                        projection_dim=CLIP_HIDDEN, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    clip.save_pretrained(root / "text_encoder_2")
    write_tokenizer(root / "text_encoder_2", VOCAB, CLIP_SPECIAL, chat_template="", add_eos=True,
                    model_max_length=77)


def write_tiny_checkpoint(root: str | Path, seed: int = 0) -> Path:
    """Write every part into a temporary folder beside root, then move it into place (no half-written checkpoint)."""
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        write_tiny_transformer(tmp / MODEL_DIR / "transformers", seed=seed, text_states_dim=LLM_HIDDEN,
                               text_states_dim_2=CLIP_HIDDEN)
        write_tiny_vae(tmp / MODEL_DIR / "vae", seed=seed)
        write_tiny_text_encoders(tmp, seed=seed)
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


if __name__ == "__main__":
    print(write_tiny_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "weights/hunyuan-video-tiny"))
