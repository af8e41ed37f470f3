"""MoE offload on this CPU, one run: decode all-resident vs offloaded, the host experts against the read bandwidth,
and the hit rate of each placement.

    python bench/bench_offload.py [--quick] [--threads 2] [--layers 2] [--experts 32] [--decode-tokens 16]
                            [--backends torch kt] [--routing-file PATH]

The bench checkpoint: sized_deepseek_v4.py's V4-Flash dimensions (hidden 4096, experts of 2048, top-6: 12.75 MiB an
expert in MXFP4) with --layers layers of --experts routed experts (--quick: hidden and experts of 256), written once
to weights/deepseek-v4-offload-bench-<layers>x<experts>[-quick]. Every measurement runs in a process of its own
(kt-kernel's thread pool slows torch in a shared process), one after the other, on --threads threads:

1. Read bandwidth: a STREAM-like read (a sum) of a 1 GiB buffer, best of 5: the host's bound.
2. Host experts alone, per backend (kt also on one worker thread: its kernel's rate on one core): one score-routed
   layer, random top-k routing, the pairs of the resident experts (0%, 12.5%, 25% of them: experts 0..N-1) left out,
   1 and 4 tokens: ms a call, the bytes it reads (its distinct host experts x an expert's bytes), the time those take
   at the measured bandwidth, and the ratio (the target: within 2x at 1 token), with the effective GB/s and GFLOP/s
   (6 H I flops a routed pair).
3. The engine, batch 1 and 4: all-resident, then each backend x resident share: decode tok/s (the engine's
   decode-only steps: batch x (D - 1) tokens over their time), the host's ms per decoded token as the decode steps spent them (ExpertOffload.host_log: the
   caller's time in the host's submit and sync), the hit rate H, and the RSS the load added. On a CPU-only machine
   "device" and "host" are the same cores: the offloaded rows give the split's cost over all-resident, not a
   speed-up.
4. Hit rates at 12.5% and 25%: measured in the engine per placement (prefix, frequency, dynamic; one request at a
   time, decode steps only), and computed offline from a routing trace of the same requests (per request, the
   (token, expert) pairs its prefill and its decode routed, from RoutingCounter, the all-resident model): prefix
   (experts 0..N-1), frequency (the top N of the other requests' counts) and dynamic (the top N of the request's own
   prefill), scored on its decode pairs. Random weights route nearly uniformly (H ~ N/E): this exercises the
   mechanism, not V4's skew. --routing-file (generate.py --record-routing, on real weights) adds the prefix and
   frequency H of that file's counts (in-sample).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench_utils import RECIPE, WEIGHTS
from common import backend, cpu_malloc
from common.offload import load_routing_counts
from tiny_deepseek_v4 import TINY_CONFIG

FRACTIONS = (0.0, 0.125, 0.25)
BATCHES = (1, 4)
PROMPT_LEN, NUM_TRACE_PROMPTS = 32, 6


def bench_config(layers: int, experts: int, quick: bool) -> dict:
    from sized_deepseek_v4 import sized_config
    if not quick:
        return sized_config(layers, experts)
    kinds = TINY_CONFIG["layer_types"][:layers], TINY_CONFIG["mlp_layer_types"][:layers]
    return {**TINY_CONFIG, "hidden_size": 256, "moe_intermediate_size": 256, "n_routed_experts": experts,
            "num_experts_per_tok": 6, "num_hidden_layers": layers, "layer_types": kinds[0],
            "mlp_layer_types": kinds[1], "num_nextn_predict_layers": 0}


def rss_anon() -> int:
    return int(re.search(r"RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes a second a sum over a `gib` GiB fp32 buffer reads, best of `repeats` (after one warm pass)."""
    buf = torch.ones(int(gib * 2**30) // 4)
    buf.sum()
    best = min(timed(buf.sum) for _ in range(repeats))
    return buf.nbytes / best


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


# ---- workers: each in its own process (`--worker JSON`), printing one JSON line ----

def host_worker(spec: dict) -> dict:
    """Host experts alone: {(fraction, tokens): [ms of each call, mean bytes read, routed host pairs]}."""
    from common.loader import Checkpoint
    from common.offload import KTKernelHostExperts, MXFP4Experts, TorchHostExperts
    from config_deepseek_v4 import ModelArgs
    ckpt = Checkpoint(spec["weights"])
    args = ModelArgs.from_config(ckpt.config)
    layer, E, k = args.mlp_layer_types.index("moe"), args.n_routed_experts, args.num_experts_per_tok
    experts = MXFP4Experts.from_checkpoint(ckpt, f"layers.{layer}.ffn.experts", E)
    per_expert = experts.nbytes / E
    if spec["backend"] == "kt":
        host = KTKernelHostExperts([(layer, experts)], k, args.swiglu_limit, max_tokens=max(BATCHES),
                                   threads=spec.get("kt_threads"))
    else:
        host = TorchHostExperts({layer: experts}, args.swiglu_limit)
    g = torch.Generator().manual_seed(0)
    out = {}
    for fraction in FRACTIONS:
        n = round(fraction * E)
        for tokens in BATCHES:
            times, reads, pairs = [], [], []
            for rep in range(2 + spec["repeats"]):  # two warm-up calls
                x = torch.randn(tokens, args.hidden_size, generator=g).to(spec["dtype"])
                ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])  # [T, k] distinct
                host_ids = torch.where(ids < n, -1, ids)  # the resident experts' pairs stay on the device
                weights = torch.rand(tokens, k, generator=g)
                seconds = timed(lambda: host.forward(layer, x, host_ids, weights))  # noqa: B023
                if rep >= 2:
                    times.append(seconds * 1e3)
                    reads.append(len(set(host_ids[host_ids >= 0].tolist())) * per_expert)
                    pairs.append(int((host_ids >= 0).sum()))
            out[f"{fraction},{tokens}"] = [times, statistics.mean(reads), statistics.mean(pairs)]
    return {"calls": out, "per_expert": per_expert, "hidden": args.hidden_size,
            "intermediate": args.moe_intermediate_size, "experts": E, "top_k": k,
            "moe_layers": len(args.mlp_layer_types)}


def load(spec: dict, offload=None, **engine):
    from transformers import AutoTokenizer

    from common.engine import LLM
    from weights_deepseek_v4 import load_model
    before = rss_anon()
    model = load_model(spec["weights"], spec["dtype"], offload=offload, max_tokens=max(BATCHES) * PROMPT_LEN)
    grew = rss_anon() - before
    llm = LLM(model, AutoTokenizer.from_pretrained(spec["weights"]), block_size=128, kv_cache_memory_bytes=2**28,
              max_num_batched_tokens=2048, enable_prefix_caching=False, **engine)
    return model, llm, grew


def greedy(llm, batch, new):
    from common.engine import SamplingParams
    return llm.generate(batch, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)


def offload_config(spec: dict, placement="prefix", frequency_file=None):
    from common.offload import MoEOffloadConfig
    if spec.get("backend") is None:
        return None
    return MoEOffloadConfig(spec["resident"], placement=placement, frequency_file=frequency_file,
                            host_backend=spec["backend"])


def engine_worker(spec: dict) -> dict:
    """One engine (all-resident or offloaded): per batch, decode tok/s and the host's ms per decoded token."""
    model, llm, grew = load(spec, offload_config(spec), max_num_seqs=max(BATCHES))
    vocab, new = model.args.vocab_size, spec["decode_tokens"]
    greedy(llm, prompts(1, vocab, 0), 2)  # warm-up
    off, out = model.offload, {"load_rss": grew}
    for b in BATCHES:
        if off is not None:
            off.host_log = []
        before = llm.engine.stats.decode_time
        greedy(llm, prompts(b, vocab, 2), new)
        seconds = llm.engine.stats.decode_time - before  # the decode-only steps': b * (new - 1) tokens
        decode = [s for _, rows, s, *_ in (off.host_log if off is not None else []) if rows == b]  # decode steps
        out[b] = {"tok_s": b * (new - 1) / seconds, "host_ms_per_token": 1e3 * sum(decode) / (b * (new - 1))}
    out["hit_rate"] = off.hit_rate() if off is not None else 1.0
    return out


def trace_worker(spec: dict) -> dict:
    """The all-resident model's routing, one request at a time: {request: {layer: [prefill counts, decode counts]}};
    also writes their summed counts as a routing-count file (spec["counts_file"]) for placement frequency."""
    from common.offload import RoutingCounter
    model, llm, _ = load(spec, max_num_seqs=1)
    E, trace, total = model.args.n_routed_experts, {}, RoutingCounter(model.args.n_routed_experts)
    for i, prompt in enumerate(prompts(NUM_TRACE_PROMPTS, model.args.vocab_size, 3)):
        counters = []
        for new in (1, spec["decode_tokens"]):  # the prefill (and one token sampled), then the whole request
            counters.append(RoutingCounter(E))
            model.record_routing(counters[-1])
            greedy(llm, [prompt], new)
        model.record_routing(None)
        prefill, whole = counters
        trace[i] = {layer: [prefill.counts[layer].tolist(), (whole.counts[layer] - prefill.counts[layer]).tolist()]
                    for layer in whole.counts}
        for layer, c in whole.counts.items():
            total.counts[layer] = total.counts.get(layer, torch.zeros(E, dtype=torch.int64)) + c
            total.tokens[layer] = total.tokens.get(layer, 0) + whole.tokens[layer]
    total.save(spec["counts_file"])
    return {"trace": trace}


def placement_worker(spec: dict) -> dict:
    """Measured H of one placement: the requests of the trace one at a time, decode steps only."""
    offload = offload_config(spec, spec["placement"], spec["counts_file"] if spec["placement"] != "prefix" else None)
    model, llm, _ = load(spec, offload, max_num_seqs=1)
    model.offload.host_log = []
    for prompt in prompts(NUM_TRACE_PROMPTS, model.args.vocab_size, 3):
        greedy(llm, [prompt], spec["decode_tokens"])
    decode = [(hits, pairs) for _, rows, _, hits, pairs in model.offload.host_log if rows == 1]
    return {"hit_rate": sum(h for h, _ in decode) / max(sum(p for _, p in decode), 1)}


WORKERS = {"host": host_worker, "engine": engine_worker, "trace": trace_worker, "placement": placement_worker}


def run_worker(spec: dict, threads: int) -> dict:
    """spec in a fresh process (this file's --worker); its JSON result."""
    cmd = [sys.executable, __file__, "--threads", str(threads), "--worker", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=RECIPE)
    if r.returncode:
        raise RuntimeError(f"bench worker {spec['kind']} failed:\n{r.stderr[-3000:]}")
    return json.loads(next(line for line in reversed(r.stdout.splitlines()) if line.startswith("{")))


# ---- offline hit rates from a trace ----

def top(counts, n: int) -> set[int]:
    return set(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:n])


def offline_hit_rates(trace: dict, n: int) -> dict[str, float]:
    """H of each placement scored on the trace's decode pairs (see the module docstring, step 4)."""
    hits, pairs = dict.fromkeys(("prefix", "frequency", "dynamic"), 0), 0
    for req, layers in trace.items():
        for layer, (prefill, decode) in layers.items():
            others = [sum(c) for c in zip(*(trace[r][layer][0] for r in trace if r != req),
                                          *(trace[r][layer][1] for r in trace if r != req))]
            chosen = {"prefix": set(range(n)), "frequency": top(others, n), "dynamic": top(prefill, n)}
            for name, experts in chosen.items():
                hits[name] += sum(decode[e] for e in experts)
            pairs += sum(decode)
    return {name: h / max(pairs, 1) for name, h in hits.items()}


def file_hit_rates(path, n: int) -> dict[str, float]:
    counts = load_routing_counts(path)
    total = sum(int(c.sum()) for c in counts.values())
    return {"prefix": sum(int(c[:n].sum()) for c in counts.values()) / total,
            "frequency (in-sample)": sum(int(c.sort(descending=True).values[:n].sum()) for c in counts.values()) / total}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="hidden and experts of 256, few repeats (a smoke run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=32, help="routed experts a layer (12.5%% and 25%% of them resident)")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="host-expert calls timed per row")
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO)
    p.add_argument("--backends", nargs="+", choices=("torch", "kt"), default=["torch", "kt"])
    p.add_argument("--routing-file", type=Path, help="a --record-routing file: its prefix / frequency hit rates")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype, line = backend.resolve_dtype(a.dtype, None)
    if a.worker:
        spec = json.loads(a.worker)
        spec["dtype"] = getattr(torch, spec["dtype"])
        print(json.dumps(WORKERS[spec["kind"]](spec)), flush=True)
        return 0
    if "kt" in a.backends:
        from common.offload import kt_kernel_unavailable
        if (reason := kt_kernel_unavailable()) is not None:
            print(f"kt-kernel left out: {reason}")
            a.backends = [b for b in a.backends if b != "kt"]
    if a.routing_file is not None and not a.routing_file.is_file():
        p.error(f"--routing-file {a.routing_file}: no such file")
    config = bench_config(a.layers, a.experts, a.quick)
    weights = WEIGHTS / f"deepseek-v4-offload-bench-{a.layers}x{a.experts}{'-quick' if a.quick else ''}"
    if not (weights / "config.json").exists() or json.loads((weights / "config.json").read_text()) != config:
        from sized_deepseek_v4 import write_sized_checkpoint
        print(f"writing the bench checkpoint {weights} ...", flush=True)
        write_sized_checkpoint(weights, config)
    E, repeats = a.experts, 2 if a.quick else a.repeats
    shares = {f: round(f * E) for f in FRACTIONS}
    base = {"weights": str(weights), "dtype": str(dtype).removeprefix("torch."), "decode_tokens": a.decode_tokens,
            "repeats": repeats, "counts_file": str(weights / "bench-routing-counts.json")}
    load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{line}; {backend.cpu_description()}; {a.threads} threads; load average {load_avg}; {weights.name}: "
          f"{a.layers} layers x {E} experts, hidden {config['hidden_size']}, experts of "
          f"{config['moe_intermediate_size']}, top-{config['num_experts_per_tok']}", flush=True)

    # kt also on one worker: its pool counts the thread that runs its task queue as a worker and the caller spins
    # in sync(), so the one-worker row is kt's kernel on one core of its own (its rate a core)
    hosts = [(b, None) for b in a.backends] + [("kt", 1)] * ("kt" in a.backends and a.threads > 1)
    jobs = [("host", h) for h in hosts] + [("engine", None)] + [("engine", b) for b in a.backends]
    runs = len(hosts) + 1 + len(a.backends) * len(FRACTIONS) + 1 + 3 * 2
    results = {}
    with tqdm(total=runs, desc="bench_offload", unit="run") as bar:
        bandwidth = read_bandwidth(0.25 if a.quick else 1.0)
        for kind, b in jobs:
            if kind == "host":
                results[("host", *b)] = run_worker({**base, "kind": "host", "backend": b[0], "kt_threads": b[1]},
                                                   a.threads)
                bar.update()
                continue
            for f in (FRACTIONS if b else (None,)):
                spec = {**base, "kind": "engine", "backend": b, "resident": shares[f] if b else None}
                results[("engine", b, f)] = run_worker(spec, a.threads)
                bar.update()
        trace = run_worker({**base, "kind": "trace"}, a.threads)["trace"]
        bar.update()
        h_backend = "kt" if "kt" in a.backends else a.backends[0]
        for f in FRACTIONS[1:]:
            for placement in ("prefix", "frequency", "dynamic"):
                spec = {**base, "kind": "placement", "backend": h_backend, "resident": shares[f],
                        "placement": placement}
                results[("placement", placement, f)] = run_worker(spec, a.threads)["hit_rate"]
                bar.update()

    print(f"\nread bandwidth (a sum over {0.25 if a.quick else 1.0:g} GiB, best of 5): {bandwidth / 1e9:.1f} GB/s")
    ratios = {}
    for b, workers in hosts:
        r = results[("host", b, workers)]
        label = b if workers is None else f"{b} on {workers} worker thread"
        print(f"\nhost experts alone, {label}: one layer of {r['experts']} experts, top-{r['top_k']}, "
              f"{r['per_expert'] / 2**20:.2f} MiB an expert (MXFP4); ms a call min / median")
        print(f"  {'resident':>9} {'tokens':>6} {'ms':>15} {'MiB read':>9} {'bound ms':>9} {'ratio':>6} "
              f"{'GB/s':>6} {'GFLOP/s':>8} {'ms / token':>11}")
        for key, (times, nbytes, pairs) in r["calls"].items():
            fraction, tokens = float(key.split(",")[0]), int(key.split(",")[1])
            best, bound = min(times), 1e3 * nbytes / bandwidth
            flops = pairs * 6 * r["hidden"] * r["intermediate"]
            ratios[(b, workers, fraction, tokens)] = best / bound if bound else float("nan")
            print(f"  {fraction:>9.1%} {tokens:>6} {best:>7.1f} / {statistics.median(times):<6.1f} "
                  f"{nbytes / 2**20:>9.1f} {bound:>9.2f} {best / bound if bound else float('nan'):>6.1f} "
                  f"{nbytes / best / 1e6:>6.2f} {flops / best / 1e6:>8.1f} "
                  f"{best * r['moe_layers'] / tokens:>11.1f}")
    print(f"\nengine decode ({a.decode_tokens} new tokens, {PROMPT_LEN}-token prompts); host ms / token: the "
          "caller's time in the host's submit + sync per decoded token, all MoE layers")
    print(f"  {'experts':<22} {'load RSS':>9} " + "".join(f"{f'batch {b} tok/s':>14} {'vs all':>7} {'host ms':>8}"
                                                       for b in BATCHES) + f" {'H':>5}")
    resident = results[("engine", None, None)]
    for key in [("engine", None, None)] + [("engine", b, f) for b in a.backends for f in FRACTIONS]:
        r = results[key]
        label = "all resident" if key[1] is None else f"{key[1]}, {shares[key[2]]}/{E} resident"
        cells = "".join(f"{r[str(b)]['tok_s']:>14.2f} {r[str(b)]['tok_s'] / resident[str(b)]['tok_s']:>7.2f} "
                        f"{r[str(b)]['host_ms_per_token']:>8.1f}" for b in BATCHES)
        print(f"  {label:<22} {r['load_rss'] / 2**20:>7.0f}Mi {cells} {r['hit_rate']:>5.2f}")
    print(f"\nhit rates (decode pairs on the device); engine: measured with {h_backend}, one request at a time; "
          f"offline: from the all-resident model's routing trace of the same {NUM_TRACE_PROMPTS} requests")
    print(f"  {'placement':<22}" + "".join(f"{f'N={shares[f]} engine':>14}{'offline':>9}" for f in FRACTIONS[1:]))
    offline = {f: offline_hit_rates(trace, shares[f]) for f in FRACTIONS[1:]}
    for placement in ("prefix", "frequency", "dynamic"):
        print(f"  {placement:<22}" + "".join(f"{results[('placement', placement, f)]:>14.3f}"
                                               f"{offline[f][placement]:>9.3f}" for f in FRACTIONS[1:]))
    print(f"  (uniform routing: N/E = {', '.join(f'{shares[f] / E:.3f}' for f in FRACTIONS[1:])}; random weights "
          "route nearly uniformly, so these exercise the mechanism, not V4's skew)")
    if a.routing_file is not None:
        for f in FRACTIONS[1:]:
            rates = file_hit_rates(a.routing_file, shares[f])
            print(f"  {a.routing_file.name}, N={shares[f]}: " + ", ".join(f"{k} {v:.3f}" for k, v in rates.items()))
    last = [f"{b}{'' if n is None else f' ({n} worker)'} host at 1 token, 0% resident: "
            f"{ratios[(b, n, 0.0, 1)]:.1f}x its bandwidth bound" for b, n in hosts]
    split = [f"{b} at 25%: {results[('engine', b, 0.25)]['1']['tok_s'] / resident['1']['tok_s']:.2f}x all-resident "
             "decode at batch 1" for b in a.backends]
    print("\n" + "; ".join(last + split) + " (target: host within 2x of its bound)")
    return 0


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    sys.exit(main())
