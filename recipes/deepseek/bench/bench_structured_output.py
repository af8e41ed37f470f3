"""Structured output's cost: the grammar mask per decode step at DeepSeek-V4's vocabulary size, and the engine's
decode tok/s with a grammar on and off, in one run.

    python bench/bench_structured_output.py [--threads 2] [--steps 64] [--decode-steps 64] [--prompt-len 128]
                                      [--repeats 2] [--dtype auto] [--quick]

Masks: the engine's own path (common/engine/structured_output.py, as LLMEngine uses it): one StructuredOutputManager
over a tokenizer of 129,280 tokens, each grammar compiled once (the first compile, then the cache's answer, timed),
then per step `apply` (xgrammar fills every row's bitmask and applies it to [batch, 129280] fp32 logits in place; the
logits part, xgrammar's CPU kernel, is timed alone again on a copy) and `accept` of the token each row takes (the
masked argmax of random logits: a random walk through the grammar; a row whose grammar terminated starts again).
Three grammars, at batch 1 and 16: `json_object`, a JSON schema (a small typed object with a long string), and the
forced tool call (xgrammar's `deepseek_v4` structural tag for two tools, tool_choice "required", as the chat
endpoint builds it). The tokenizer is synthetic (no real 129k vocabulary is available offline): a byte-level BPE
vocabulary of 129,280 tokens (the tiny checkpoint's special tokens, the 256 bytes, then distinct byte strings drawn
with a fixed seed: 70% lowercase words of 1-12 letters, half with a leading space, some capitalised; 15% one or two
CJK characters; 15% runs of punctuation and digits), so it has the real vocabulary's size and a plausible spread of
token lengths, not its exact strings.

Decode: the engine on bench.py's checkpoint (written if missing; 16,384-row lm-head and its small trained
tokenizer) decodes --decode-steps steps of 1 and 16 requests (--prompt-len prompts, greedy) with no grammar and with
the JSON schema (its long string keeps every request decoding): tok/s over decode-only steps, each side's best of
--repeats. The last line gives the slowdown and what the 129k masks measured above would add to this
checkpoint's steps. Prints the CPU, a progress bar, the tables and one line of ratios.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import xgrammar as xgr
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common import backend, cpu_malloc
from common.engine import LLM, SamplingParams
from common.engine.sampling_params import StructuredOutputsParams
from common.engine.structured_output import StructuredOutputManager
from bench_utils import BENCH, BENCH_CONFIG, ensure_bench, prompts
from chat_format_deepseek_v4 import DeepseekV4ChatFormat
from tiny_deepseek_v4 import SPECIAL_TOKENS
from weights_deepseek_v4 import load_model

VOCAB_SIZE = 129280  # DeepSeek-V4's (and V3's) vocabulary: the lm-head rows a mask covers
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 32}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "summary": {"type": "string", "minLength": 512}}, "required": ["city", "days", "summary"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 32}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
             "query": {"type": "string"}, "top_k": {"type": "integer"}}, "required": ["query"]}}}]
ENGINE = dict(block_size=128, max_num_seqs=16, max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=512 << 20)
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
LETTER_WEIGHTS = [12, 9, 8, 7.5, 7, 6.7, 6.3, 6, 5.9, 4.3, 4, 2.8, 2.8, 2.4, 2.4, 2.2, 2, 2, 1.9, 1.5, 1, .8, .15,
                  .15, .1, .07]


def byte_level_alphabet() -> dict[int, str]:
    """Byte -> the character a byte-level BPE vocabulary writes it as (printable Latin-1 bytes as themselves, the
    others shifted past U+0100 in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def synthetic_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly vocab_size tokens (see the module docstring); built in memory."""
    alphabet = byte_level_alphabet()
    specials = list(SPECIAL_TOKENS.values())
    tokens = specials + [alphabet[b] for b in range(256)]
    seen, rng = set(tokens), random.Random(seed)
    while len(tokens) < vocab_size:
        r = rng.random()
        if r < 0.7:
            word = "".join(rng.choices(LETTERS, LETTER_WEIGHTS, k=min(12, 1 + int(rng.expovariate(1 / 4.5)))))
            word = word.capitalize() if rng.random() < 0.1 else word
            text = (" " if rng.random() < 0.5 else "") + word
        elif r < 0.85:
            text = "".join(chr(rng.randrange(0x4E00, 0xA000)) for _ in range(rng.randint(1, 2)))
        else:
            text = "".join(rng.choices('{}[]()":,.;_-+=*/\\<>!?#%&|0123456789 \n\t', k=rng.randint(2, 4)))
        token = "".join(alphabet[b] for b in text.encode())
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS["bos"],
                                   eos_token=SPECIAL_TOKENS["eos"])


def grammars() -> dict[str, StructuredOutputsParams]:
    tag = DeepseekV4ChatFormat().tool_call_grammar(TOOLS, "required", parallel_tool_calls=True)
    return {"json_object": StructuredOutputsParams(json_object=True),
            "json_schema": StructuredOutputsParams(json=SCHEMA),
            "tool call (structural tag)": StructuredOutputsParams(structural_tag=tag)}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def mask_steps(manager: StructuredOutputManager, params: StructuredOutputsParams, batch: int, steps: int,
               seed: int, warmup: int = 4) -> tuple[float, float, float]:
    """Median seconds a step spends in `apply` (fill the batch's masks and apply them), in applying the filled
    masks alone (xgrammar's CPU kernel over the logits, as `apply` calls it, timed again on a copy), and in
    `accept` (every row's token)."""
    g = torch.Generator().manual_seed(seed)
    states = [manager.start(params, [0]) for _ in range(batch)]
    times = []
    for step in range(warmup + steps):
        logits = torch.randn(batch, manager.vocab_size, generator=g)  # [B, V] fp32, as the sampler's
        fresh = logits.clone()
        t_apply = timed(lambda: manager.apply(logits, [(s, i, []) for i, s in enumerate(states)]))
        t_logits = timed(lambda: xgr.apply_token_bitmask_inplace(fresh, manager.bitmask[:batch],
                                                                 vocab_size=manager.vocab_size,
                                                                 indices=list(range(batch))))
        tokens = logits.argmax(-1).tolist()  # an allowed token of each row
        t_accept = timed(lambda: [manager.accept(s, t) or fail(t) for s, t in zip(states, tokens)])
        states = [manager.start(params, [0]) if manager.is_terminated(s) else s for s in states]
        if step >= warmup:
            times.append((t_apply, t_logits, t_accept))
    return tuple(statistics.median(t[i] for t in times) for i in range(3))


def fail(token: int):
    raise AssertionError(f"a masked row took token {token}, which its grammar forbids")


def decode_tok_s(llm: LLM, batch: int, steps: int, params: SamplingParams, vocab: int, seed: int,
                 prompt_len: int) -> float:
    """Tokens per second over `steps` decode-only engine steps of `batch` requests."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts(batch, prompt_len, vocab, seed)]
    s = engine.stats
    before = -1
    while s.prefill_tokens != before:  # the prompts' prefill (and the first token)
        before = s.prefill_tokens
        engine.step()
    tokens, t0 = s.decode_tokens, time.perf_counter()
    for _ in range(steps):
        engine.step()
    tok_s = (s.decode_tokens - tokens) / (time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    return tok_s


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=64, help="mask steps timed per grammar and batch size")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per engine run")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--repeats", type=int, default=2, help="decode runs per side, alternating; each side's best")
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO,
                   help="the bench checkpoint's weights (auto: backend.default_dtype(), which follows the CPU)")
    p.add_argument("--quick", action="store_true", help="16 mask steps, 8 decode steps of 32-token prompts, one "
                   "repeat (a smoke run, not the numbers)")
    a = p.parse_args()
    if a.quick:
        a.steps, a.decode_steps, a.prompt_len, a.repeats = 16, 8, 32, 1
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    dtype, dtype_line = backend.resolve_dtype(a.dtype, None)
    print(f"{dtype_line}; {backend.cpu_model_name()}, {backend.cpu_description()}; {a.threads} threads", flush=True)
    batches = (1, 16)
    bar = tqdm(total=3 * len(batches) + 2 * len(batches) * a.repeats + 2, desc="bench", unit="run")

    tokenizer = synthetic_tokenizer()
    t0 = time.perf_counter()
    manager = StructuredOutputManager(tokenizer, VOCAB_SIZE, [tokenizer.eos_token_id])
    setup = time.perf_counter() - t0
    bar.update()
    masks = {}  # grammar -> (first compile s, cached compile s, {batch: (mask s, its logits part s, accept s)})
    for name, params in grammars().items():
        first = timed(lambda: manager.compile(params))
        cached = timed(lambda: manager.compile(params))
        per_batch = {}
        for b in batches:
            per_batch[b] = mask_steps(manager, params, b, a.steps, seed=b)
            bar.update()
        masks[name] = first, cached, per_batch

    ensure_bench()
    llm = LLM(load_model(BENCH, dtype), AutoTokenizer.from_pretrained(BENCH), **ENGINE)
    vocab = BENCH_CONFIG["vocab_size"]
    free = SamplingParams(temperature=0, max_tokens=a.decode_steps + 8, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=a.decode_steps + 8, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    decode_tok_s(llm, 2, 4, constrained, vocab, seed=99, prompt_len=a.prompt_len)  # warm-up, the schema's compile
    bar.update()
    decode = {}  # batch -> (tok/s without, tok/s with)
    for b in batches:
        runs = []
        for _ in range(a.repeats):  # free and constrained alternate
            runs.append([decode_tok_s(llm, b, a.decode_steps, params, vocab, seed=b, prompt_len=a.prompt_len)
                         for params in (free, constrained)])
            bar.update(2)
        decode[b] = tuple(max(r[i] for r in runs) for i in range(2))
    bar.close()

    print(f"\nmasks: {VOCAB_SIZE:,}-token synthetic byte-level vocabulary, xgrammar through StructuredOutputManager "
          f"(TokenizerInfo + compiler built in {setup:.1f} s); per step, medians of {a.steps}: mask = apply (fill "
          f"the batch's bitmasks, apply them to [batch, {VOCAB_SIZE}] fp32 logits), of which the logits part; "
          f"accept = every row's token")
    print(f"{'grammar':<28}{'compile ms':>12}{'cached ms':>11}{'batch':>7}{'mask ms':>10}{'(logits)':>10}"
          f"{'accept ms':>11}{'mask us/row':>13}")
    for name, (first, cached, per_batch) in masks.items():
        for b in batches:
            mask, logits_part, accept = per_batch[b]
            head = f"{name:<28}{first * 1e3:>12.1f}{cached * 1e3:>11.3f}" if b == batches[0] else " " * 51
            print(f"{head}{b:>7}{mask * 1e3:>10.3f}{logits_part * 1e3:>10.3f}{accept * 1e3:>11.3f}"
                  f"{mask / b * 1e6:>13.1f}")
    print(f"\ndecode: bench checkpoint ({BENCH.name}, {vocab:,}-row lm-head, {backend.dtype_name(dtype)}), "
          f"{a.decode_steps} decode steps of {a.prompt_len}-token prompts, greedy; JSON schema on or off; best of "
          f"{a.repeats}")
    print(f"{'batch':<8}{'tok/s free':>12}{'tok/s schema':>14}{'free/schema':>13}{'ms/step free':>14}"
          f"{'ms/step schema':>16}")
    for b in batches:
        free_v, with_v = decode[b]
        print(f"{b:<8}{free_v:>12.1f}{with_v:>14.1f}{free_v / with_v:>12.2f}x{b / free_v * 1e3:>14.1f}"
              f"{b / with_v * 1e3:>16.1f}")
    schema = masks["json_schema"][2]
    share = {b: (schema[b][0] + schema[b][2]) / (b / decode[b][0]) for b in batches}  # 129k mask + accept / step
    mask_ratio = {name: per[2][16][0] / per[2][1][0] for name, per in masks.items()}
    print("ratios: mask apply batch16/batch1 " + ", ".join(f"{n} {r:.1f}x" for n, r in mask_ratio.items())
          + "; decode free/schema " + ", ".join(f"batch{b} {decode[b][0] / decode[b][1]:.2f}x" for b in batches)
          + "; the 129k schema mask (apply + accept) = " + ", ".join(f"{share[b] * 100:.1f}% of a batch-{b} step"
                                                                     for b in batches) + " of this checkpoint")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
