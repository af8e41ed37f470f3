"""Offline batch inference with Ling-3.0-Flash through the paged-KV, continuously batching engine (the MLA layers'
latent cache in blocks, the KDA layers' recurrent states in per-request slots).

    python generate_ling.py [--weights DIR] [--config configs/X.yaml] [--prompts FILE | --prompt TEXT]
                            [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]

With no --weights, a tiny random checkpoint in the publisher's format is written to weights/ling-tiny (once) and
used. Each prompt line goes through the tokenizer's chat template as one user message. A preset of several ranks
(configs/tiny-cpu-tp2.yaml, tiny-cpu-dp2-ep2.yaml) runs this again under torchrun; rank 0 prints.
"""
from __future__ import annotations

import sys

from common import backend
from common import parallel as par
from common.cli_paths import input_path
from common.engine import LLM, SamplingParams
from common.serving.chat_format import Conversation, TemplateChatFormat
from cli_ling import HERE, ArgumentParser, add_model_args, check_model_args, fail, load


def parse_args(argv=None):
    p = ArgumentParser(prog="run.sh", description="Ling-3.0-Flash offline inference")
    add_model_args(p)
    p.add_argument("--prompts", type=input_path(HERE), default=HERE / "prompts.txt", help="one prompt per line")
    p.add_argument("--prompt", help="one prompt instead of --prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int)
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error(f"max_tokens must be >= 1, got {a.max_tokens}")
    if a.prompt is None and not a.prompts.is_file():
        p.error(f"--prompts {a.prompts}: no such file")
    try:
        a.sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                                    max_tokens=a.max_tokens)
    except ValueError as e:
        p.error(str(e))
    check_model_args(p, a)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    model, tokenizer, config = load(a)
    try:
        llm = LLM(model, tokenizer, config)
    except ValueError as e:  # settings that can never run (checked when the engine is built)
        fail(e)
    prompts = [a.prompt] if a.prompt is not None else [
        line.strip() for line in a.prompts.read_text().splitlines() if line.strip()]
    chat = TemplateChatFormat(tokenizer)  # as the server renders a chat request
    inputs = [chat.encode(Conversation([{"role": "user", "content": p}])).text for p in prompts]
    backend.reset_peak_memory()
    outputs = llm.generate(inputs, a.sampling, add_special_tokens=False)  # the template wrote its special tokens
    engine = llm.engine
    s = engine.stats  # per DP rank (TP peers run the same requests): summed tokens over the slowest rank's time
    ranks = par.all_gather_object((s.prefill_tokens, s.prefill_time, s.decode_tokens, s.decode_time,
                                   backend.peak_memory_bytes()), engine.dp_group)
    par.destroy_parallel()
    if engine.parallel.rank != 0:
        return 0
    for prompt, out in zip(prompts, outputs):
        print(f"> {prompt}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    prefill, prefill_time, decode, decode_time, peak = (list(x) for x in zip(*ranks))
    print(f"requests={len(outputs)} prompt_tokens={sum(len(o.prompt_token_ids) for o in outputs)} "
          f"generated_tokens={sum(len(o.token_ids) for o in outputs)} "
          f"prefill_tok/s={sum(prefill) / max(max(prefill_time), 1e-9):.1f} "
          f"decode_tok/s={sum(decode) / max(max(decode_time), 1e-9):.1f} "
          f"peak_memory={max(peak) / 2**20:.0f}MiB ranks={engine.parallel.world_size} device={backend.device_type()}"
          + (f" mtp_drafts={s.num_draft_tokens} acceptance={s.acceptance_rate:.2f} "
             f"mean_accepted_length={s.mean_accepted_length:.2f}" if engine.config.num_speculative_tokens else "")
          + (f" exe_mode={engine.config.exe_mode} graph_buckets={','.join(map(str, graphs.buckets))} "
             f"graph_steps={sum(graphs.replays.values())} compile_s={graphs.capture_seconds:.1f}"
             if (graphs := engine.runner.graphs) is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
