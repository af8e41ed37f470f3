"""Offline batch inference with DeepSeek-V4 through the paged-KV, continuously batching engine.

    python generate.py [--weights DIR] [--config configs/X.yaml] [--prompts FILE] [--max-tokens N]
                       [--temperature T] [--top-p P] [--top-k K] [--seed S]

With no --weights, a tiny random checkpoint in the publisher's format is written to weights/deepseek-v4-tiny
(once) and used. Each prompt line goes through the tokenizer's chat template.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoTokenizer

from common import backend
from common.engine import LLM, SamplingParams
from common.loader import CheckpointError
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model

HERE = Path(__file__).resolve().parent
TINY = HERE.parents[1] / "weights" / "deepseek-v4-tiny"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="run.sh", description="DeepSeek-V4 offline inference")
    p.add_argument("--weights", type=Path, help="checkpoint folder (default: the tiny random checkpoint)")
    p.add_argument("--config", type=Path, default=HERE / "configs" / "tiny-cpu.yaml", help="deployment preset")
    p.add_argument("--prompts", type=Path, default=HERE / "prompts.txt", help="one prompt per line")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="overrides the preset's dtype")
    a = p.parse_args(argv)
    for flag, path, kind in (("--prompts", a.prompts, "file"), ("--config", a.config, "file"), ("--weights", a.weights, "dir")):
        if path is not None and not (path.is_file() if kind == "file" else path.is_dir()):
            p.error(f"{flag} {path}: no such {'file' if kind == 'file' else 'directory'}")
    try:
        a.sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                                    max_tokens=a.max_tokens)
    except ValueError as e:
        p.error(str(e))
    try:
        a.preset = yaml.safe_load(a.config.read_text()) or {}
    except yaml.YAMLError as e:
        p.error(f"--config {a.config}: not valid YAML ({str(e).splitlines()[0]})")
    world = 1
    for size in (a.preset.get("parallel") or {}).values():
        world = max(world, int(size))
    if world > 1:
        p.error(f"--config {a.config.name} needs {world} ranks; multi-rank runs arrive with the distributed executor")
    a.dtype = DTYPES[a.dtype or a.preset.get("dtype", "bf16")]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    path = a.weights or TINY
    if a.weights is None and not (TINY / "config.json").exists():
        write_tiny_checkpoint(TINY)
    try:
        model = load_model(path, a.dtype, backend.device())
        llm = LLM(model, AutoTokenizer.from_pretrained(path), **(a.preset.get("engine") or {}))
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
        return 2
    prompts = [line.strip() for line in a.prompts.read_text().splitlines() if line.strip()]
    texts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    backend.reset_peak_memory()
    outputs = llm.generate(texts, a.sampling)
    for prompt, out in zip(prompts, outputs):
        print(f"> {prompt}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    s = llm.engine.stats
    print(f"requests={len(outputs)} prompt_tokens={sum(len(o.prompt_token_ids) for o in outputs)} "
          f"generated_tokens={sum(len(o.token_ids) for o in outputs)} "
          f"prefill_tok/s={s.prefill_tokens / max(s.prefill_time, 1e-9):.1f} "
          f"decode_tok/s={s.decode_tokens / max(s.decode_time, 1e-9):.1f} "
          f"peak_memory={backend.peak_memory_bytes() / 2**20:.0f}MiB device={backend.device_type()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
