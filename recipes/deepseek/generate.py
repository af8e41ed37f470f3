"""Greedy generation with DeepSeek-V4 by full recompute (no KV cache): the smoke run of the model.

    python generate.py [--weights DIR] [--prompts FILE] [--max-tokens N] [--dtype bf16|fp32]

With no --weights, a tiny random checkpoint in the publisher's format is written to weights/deepseek-v4-tiny
(once) and used. The paged, continuously batching executor replaces this loop for real serving.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from common import backend
from common.loader import CheckpointError
from modeling_deepseek_v4 import Batch
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "weights" / "deepseek-v4-tiny"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description="DeepSeek-V4 greedy generation (full recompute)")
    p.add_argument("--weights", type=Path, help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--prompts", type=Path, default=Path(__file__).with_name("prompts.txt"), help="one prompt per line")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if not a.prompts.is_file():
        p.error(f"--prompts {a.prompts}: no such file")
    if a.weights is not None and not a.weights.is_dir():
        p.error(f"--weights {a.weights}: no such directory")
    return a


@torch.no_grad()
def greedy(model, prompt_ids: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    outs = [[] for _ in prompt_ids]
    live = list(range(len(prompt_ids)))
    for _ in range(max_tokens):
        batch = Batch.from_prompts([prompt_ids[i] + outs[i] for i in live], backend.device())
        hidden = model(batch)[batch.cu_seqlens[1:].long() - 1]  # last token of each sequence
        for i, tok in zip(live, model.compute_logits(hidden).argmax(-1).tolist()):
            outs[i].append(tok)
        live = [i for i in live if outs[i][-1] not in eos]
        if not live:
            break
    return outs


def main(argv=None) -> int:
    a = parse_args(argv)
    path = a.weights
    if path is None:
        path = TINY
        if not (TINY / "config.json").exists():
            write_tiny_checkpoint(TINY)
    try:
        model = load_model(path, DTYPES[a.dtype], backend.device())
    except CheckpointError as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [line.strip() for line in a.prompts.read_text().splitlines() if line.strip()]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]  # the template already has the BOS
    t0 = time.perf_counter()
    outs = greedy(model, ids, a.max_tokens, set(model.args.eos_token_ids))
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        print(f"> {p}\n{tok.decode(o, skip_special_tokens=True)!r}")
    n = sum(map(len, outs))
    print(f"requests={len(prompts)} prompt_tokens={sum(map(len, ids))} generated_tokens={n} "
          f"tok/s={n / dt:.1f} device={backend.device_type()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
