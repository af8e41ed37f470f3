"""Train an MTP layer for a checkpoint that has none, on the model's own generated text, and write the checkpoint
with it (`mtp.0.*`, num_nextn_predict_layers 1): what makes the bench's speculative decoding meaningful (a random
MTP layer accepts almost nothing).

    python bench/train_mtp.py [--weights DIR] [--out DIR] [--minutes 3] [--sequences 48] [--length 192] [--threads 2]

DIR defaults to the bench checkpoint (written if absent), --out to DIR-mtp. Steps:
1. text: --sequences prompts of 32 random tokens, continued greedily by the engine to --length tokens;
2. targets: the main model's own next-token choices over each whole sequence (its argmax at t + 1 is what the MTP
   at t must predict: the token after next), with its residual streams, computed once (fp32, no gradients);
3. the MTP block starts from the last decoder layer's attention / MoE / norms (the shapes match; it has no
   compressor), the main model's hc_head and norm, e_proj = h_proj = identity / 2; then AdamW on the MTP block
   alone (embedding and head shared and frozen), cross-entropy over every position, for --minutes;
4. acceptance: on the last 1/8 of the sequences (not trained on), how often the MTP's argmax is the main model's
   token after next, printed with the loss as it trains;
5. the output: DIR's files, its config with num_nextn_predict_layers 1 and a shard `mtp.safetensors` (the
   model's own names, fp32 as trained, which load_model(mtp=True) reads), the index listing both.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer

from bench_utils import BENCH, ensure_bench
from common.engine import LLM, SamplingParams
from common.engine.forward_batch import ForwardBatch
from common.engine.model_runner import bind_new_caches
from common.loader.checkpoint import INDEX
from modeling_deepseek_v4 import MTPBlock, make_ropes
from weights_deepseek_v4 import load_model

BLOCK = 128


def generate(path: Path, n: int, length: int, vocab: int) -> list[list[int]]:
    """n greedy continuations of random 32-token prompts, each `length` tokens in all."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (32,), generator=g).tolist() for _ in range(n)]
    llm = LLM(load_model(path, torch.bfloat16), AutoTokenizer.from_pretrained(path), block_size=BLOCK,
              max_num_seqs=16, max_num_batched_tokens=2048, enable_prefix_caching=False, kv_cache_memory_bytes=2**29)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=length - 32, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def fresh_batch(model, seq: list[int]) -> ForwardBatch:
    groups = [g.name for g in model.cache_specs(BLOCK)]
    batch, blocks = ForwardBatch.prefill([seq], groups, BLOCK)
    bind_new_caches(model, dict.fromkeys(groups, blocks), BLOCK)
    return batch


def mtp_block(model) -> MTPBlock:
    """An MTP block for `model`, initialised from its last layer (see the module doc)."""
    a = model.args
    args = dataclasses.replace(a, num_nextn_predict_layers=1)
    block = MTPBlock(args, 0, make_ropes(a), model.parallel)
    last = dict(model.layers[-1].state_dict())
    state = block.state_dict()
    for name in state:
        if name in last and last[name].shape == state[name].shape:
            state[name] = last[name].clone()
    for name, src in (("hc_head_fn", model.hc_head_fn), ("hc_head_base", model.hc_head_base),
                      ("hc_head_scale", model.hc_head_scale), ("norm.weight", model.norm.weight)):
        state[name] = src.detach().clone()
    eye = torch.eye(a.hidden_size) / 2
    state["e_proj.weight"], state["h_proj.weight"] = eye.clone(), eye.clone()
    block.load_state_dict(state)
    return block


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, default=BENCH)
    p.add_argument("--out", type=Path)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--sequences", type=int, default=48)
    p.add_argument("--length", type=int, default=192)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out = a.out or a.weights.with_name(a.weights.name + "-mtp")
    if a.weights == BENCH:
        ensure_bench()
    model = load_model(a.weights, torch.float32)
    model.requires_grad_(False)
    print(f"1. generating {a.sequences} sequences of {a.length} tokens", flush=True)
    seqs = generate(a.weights, a.sequences, a.length, model.args.vocab_size)

    print("2. the main model's streams and next-token choices", flush=True)
    data = []  # (seq, streams [T-1, n, D], targets [T-2]: the main model's choice at t + 1, for the MTP at t)
    with torch.no_grad():
        for seq in tqdm(seqs, unit="seq"):
            batch = fresh_batch(model, seq)
            streams = model.residual_streams(batch)  # [T, n, D]
            choice = model.compute_logits(model.final_hidden(streams)).argmax(-1)  # [T]: token after each position
            data.append((seq, streams[:-2], choice[1:-1]))
    held = max(1, len(data) // 8)
    train, test = data[:-held], data[-held:]

    block = mtp_block(model)
    model.mtp = torch.nn.ModuleList([block])  # the caches bound and the MTP forward see it
    block.requires_grad_(True)
    opt = torch.optim.AdamW([q for q in block.parameters() if q.requires_grad], lr=a.lr, weight_decay=0.0)

    def run(seq, streams, grad: bool):
        batch = fresh_batch(model, seq[:-2])  # positions 0..T-3; the MTP at t reads token t + 1
        with torch.set_grad_enabled(grad):
            nxt = model.embed_tokens(torch.tensor(seq[1:-1]))
            return model.compute_logits(block.final_hidden(block(streams, nxt, batch)))  # [T-2, V]

    def acceptance() -> float:
        hits = total = 0
        with torch.no_grad():
            for seq, streams, target in test:
                hits += int((run(seq, streams, False).argmax(-1) == target).sum())
                total += len(target)
        return hits / total

    print(f"3. training the MTP block for {a.minutes} min (acceptance before: {acceptance():.3f})", flush=True)
    deadline, step, t0 = time.monotonic() + 60 * a.minutes, 0, time.monotonic()
    bar = tqdm(total=int(60 * a.minutes), unit="s", desc="train")
    while time.monotonic() < deadline:
        seq, streams, target = train[step % len(train)]
        loss = F.cross_entropy(run(seq, streams, True), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        bar.n = min(int(time.monotonic() - t0), bar.total)
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}")
        if step % 50 == 0:
            bar.write(f"step {step}: loss {loss.item():.3f}, held-out acceptance {acceptance():.3f}")
    bar.close()
    rate = acceptance()
    print(f"4. held-out acceptance of one draft (MTP argmax == the main model's token after next): {rate:.3f} "
          f"after {step} steps", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    for f in a.weights.iterdir():
        if f.is_file() and f.name not in ("config.json", INDEX):
            shutil.copy2(f, out / f.name)
    config = json.loads((a.weights / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {f"mtp.0.{k}": v.detach().contiguous() for k, v in block.state_dict().items()}  # fp32, as trained
    save_file(tensors, out / "mtp.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: "mtp.safetensors" for name in tensors}}
    for shard in sorted(out.glob("*.safetensors")):
        if shard.name != "mtp.safetensors":
            with safe_open(shard, "pt") as f:
                index["weight_map"] |= {name: shard.name for name in f.keys()}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "mtp_training.json").write_text(json.dumps({"steps": step, "held_out_acceptance": rate,
                                                       "minutes": a.minutes, "sequences": a.sequences,
                                                       "length": a.length}) + "\n")
    print(f"5. wrote {out} (mtp.safetensors + {INDEX}); python bench/bench_mtp.py reads it", flush=True)


if __name__ == "__main__":
    main()
