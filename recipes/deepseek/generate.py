"""Offline batch inference with DeepSeek-V4 through the paged-KV, continuously batching engine.

    python generate.py [--weights DIR] [--config configs/X.yaml] [--prompts FILE | --prompt TEXT [--image FILE ...]]
                       [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--speculative-tokens K]
                       [--offload-experts N [--placement prefix|frequency|dynamic] [--frequency-file PATH]
                        [--host-backend torch|kt]] [--record-routing PATH]

With no --weights, a tiny random checkpoint in the publisher's format is written to weights/deepseek-v4-tiny
(once) and used. Each prompt line goes through the model's chat format. `--image FILE` (repeatable, a vision
checkpoint: DeepSeek-V4-Flash-Vision-Exp's layout, as the tiny one is) puts the images before the text of the one
prompt, each an image content part of the user message.
"""
from __future__ import annotations

import sys

from common import backend
from common import parallel as par
from common.cli_paths import input_path, output_path
from common.engine import LLM, SamplingParams
from common.offload import RoutingCounter
from common.serving.chat_format import Conversation, TemplateChatFormat
from cli_deepseek import HERE, ArgumentParser, add_model_args, check_model_args, fail, load


def parse_args(argv=None):
    p = ArgumentParser(prog="run.sh", description="DeepSeek-V4 offline inference")
    add_model_args(p)
    p.add_argument("--prompts", type=input_path(HERE), default=HERE / "prompts.txt", help="one prompt per line")
    p.add_argument("--prompt", help="one prompt instead of --prompts")
    p.add_argument("--image", type=input_path(HERE), action="append", default=[], metavar="FILE",
                   help="an image for --prompt (repeatable: several images, in order)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int)
    p.add_argument("--record-routing", type=output_path, metavar="PATH", help="write the run's routing counts per MoE "
                   "layer (the --frequency-file of placement frequency)")
    a = p.parse_args(argv)
    if a.record_routing is not None and not a.record_routing.resolve().parent.is_dir():
        p.error(f"--record-routing {a.record_routing}: no such directory {a.record_routing.resolve().parent}")
    if a.max_tokens < 1:  # offline runs generate; scoring a prompt alone is the server's echo
        p.error(f"max_tokens must be >= 1, got {a.max_tokens}")
    if a.prompt is None and not a.prompts.is_file():
        p.error(f"--prompts {a.prompts}: no such file")
    if a.image and a.prompt is None:
        p.error("--image goes with --prompt TEXT (the question about the images)")
    for image in a.image:
        if not image.is_file():
            p.error(f"--image {image}: no such file")
    try:
        a.sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                                    max_tokens=a.max_tokens)
    except ValueError as e:
        p.error(str(e))
    check_model_args(p, a)
    if a.record_routing is not None and not a.family.supports_offload:
        p.error(f"--record-routing counts DeepSeek-V4's routed experts (MoE offload); {a.family.name} has no offload")
    if a.record_routing is not None and a.exe_mode != "eager":
        p.error("--record-routing counts on the host in eager steps (a graph step's padding rows are routed too): "
                "use --exe-mode eager")
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
    # the prompts as the server renders them: the family's chat format, else the tokenizer's template
    chat = a.family.chat_format() if a.family.chat_format else TemplateChatFormat(tokenizer)
    try:
        inputs = [chat_input(chat, p, a.image) for p in prompts]
    except ValueError as e:
        fail(e)
    counter = None
    if a.record_routing is not None:
        counter = RoutingCounter(model.args.n_routed_experts)
        model.record_routing(counter)
    backend.reset_peak_memory()
    try:  # the chat format wrote its BOS
        outputs = llm.generate(inputs, a.sampling, add_special_tokens=False)
    except ValueError as e:  # an image the model cannot take (or a model that takes none)
        fail(e)
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
             if (graphs := engine.runner.graphs) is not None else "")
          + (f" offload={off.num_slots}/{off.resident.num_experts} placement={a.offload.placement} "
             f"host={a.offload.host_backend} resident_hit_rate={off.hit_rate():.2f} swaps={off.swaps}"
             if a.family.supports_offload and (off := model.offload) is not None else ""))
    if counter is not None:
        counter.save(a.record_routing)
        print(f"routing counts of {len(counter.counts)} MoE layers written to {a.record_routing}")
    return 0


def chat_input(chat, prompt: str, images: list) -> str | dict:
    """One user message through the chat format: its text, or with images (image parts first, then the text) the
    engine's multimodal prompt {"prompt", "multi_modal_data": {"image": files in prompt order}}."""
    if not images:
        return chat.encode(Conversation([{"role": "user", "content": prompt}])).text
    parts = [{"type": "image_url", "image_url": {"url": str(path)}} for path in images]
    rendered = chat.encode(Conversation([{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]))
    return {"prompt": rendered.text, "multi_modal_data": {"image": [part["image_url"]["url"]
                                                                    for part in rendered.images]}}


if __name__ == "__main__":
    sys.exit(main())
