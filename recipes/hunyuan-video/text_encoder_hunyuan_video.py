"""HunyuanVideo's two text encoders, through transformers' own model classes.

1. A Llama-architecture LLM (the publisher's llava-llama-3-8b text tower, `text_encoder/`): the prompt is wrapped in
   the video-description template, tokenized to crop_start + 256 tokens (padded), and the hidden states of the
   layer `hidden_state_skip_layer` from the end (2: hidden_states[-3]) are taken; the template's own tokens
   (crop_start of them) are cropped off the front. Out: text_states [B, 256, 4096] and its mask [B, 256].
2. CLIP-L's text tower (`text_encoder_2/`): pooled output [B, 768] of the prompt padded to 77 tokens.
Both folders carry their tokenizer, as the publisher's do.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, CLIPTextModel, LlamaModel

PROMPT_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)


@dataclass(frozen=True)
class TextEncoderConfig:
    max_length: int = 256  # LLM tokens kept after the template is cropped
    clip_max_length: int = 77
    hidden_state_skip_layer: int = 2  # hidden_states[-(skip + 1)]
    template: str = PROMPT_TEMPLATE
    crop_start: int | None = None  # None: the number of tokens of the template before the prompt (95 upstream)

    def __post_init__(self):
        if self.template.count("{}") != 1:
            raise ValueError("text encoder template: needs exactly one {} where the prompt goes")
        if self.max_length < 1 or self.clip_max_length < 2 or self.hidden_state_skip_layer < 0:
            raise ValueError(f"text encoder config: bad lengths or skip layer in {self}")


class HunyuanVideoTextEncoders:
    def __init__(self, tokenizer, text_encoder: LlamaModel, tokenizer_2, text_encoder_2: CLIPTextModel,
                 config: TextEncoderConfig = TextEncoderConfig()):
        self.tokenizer, self.text_encoder = tokenizer, text_encoder.eval()
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2.eval()
        self.config = config
        if config.hidden_state_skip_layer >= text_encoder.config.num_hidden_layers:
            raise ValueError(f"hidden_state_skip_layer {config.hidden_state_skip_layer} >= the LLM's "
                             f"{text_encoder.config.num_hidden_layers} layers")
        prefix = config.template.split("{}")[0]
        self.crop_start = (config.crop_start if config.crop_start is not None
                           else len(tokenizer(prefix).input_ids))  # includes bos, as the template is cropped after it

    @classmethod
    def from_pretrained(cls, root: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                        config: TextEncoderConfig = TextEncoderConfig()) -> "HunyuanVideoTextEncoders":
        root = Path(root)
        return cls(AutoTokenizer.from_pretrained(root / "text_encoder"),
                   LlamaModel.from_pretrained(root / "text_encoder", dtype=dtype).to(device),
                   AutoTokenizer.from_pretrained(root / "text_encoder_2"),
                   CLIPTextModel.from_pretrained(root / "text_encoder_2", dtype=dtype).to(device), config)

    @property
    def device(self) -> torch.device:
        return self.text_encoder.device

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prompts -> text_states [B, max_length, D_llm], text_mask [B, max_length] (1 = token), pooled [B, D_clip]."""
        cfg = self.config
        llm_in = self.tokenizer([cfg.template.format(p) for p in prompts], padding="max_length", truncation=True,
                                max_length=self.crop_start + cfg.max_length, return_tensors="pt").to(self.device)
        hidden = self.text_encoder(input_ids=llm_in.input_ids, attention_mask=llm_in.attention_mask,
                                   output_hidden_states=True).hidden_states[-(cfg.hidden_state_skip_layer + 1)]
        text_states = hidden[:, self.crop_start:]  # [B, max_length, D_llm]
        text_mask = llm_in.attention_mask[:, self.crop_start:]  # [B, max_length]
        clip_ids = self.tokenizer_2(prompts, padding="max_length", truncation=True, max_length=cfg.clip_max_length,
                                    return_tensors="pt").input_ids.to(self.device)
        pooled = self.text_encoder_2(clip_ids).pooler_output  # [B, D_clip]
        return text_states, text_mask, pooled
