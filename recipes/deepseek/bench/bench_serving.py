"""Serving benchmark over the OpenAI API: TTFT, TPOT, inter-token latency and throughput under load.

    python bench/bench_serving.py [--base-url http://127.0.0.1:8000/v1] [--api-key K] [--model NAME]
                            [--concurrency 16 | --request-rate R] [--num-prompts 64]
                            [--input-len 128] [--output-len 128] [--seed 0] [--prompts FILE [--chat]]
                            [--launch [--weights DIR] [--config C] [--port P]] [--offline-baseline] [--json OUT]

Requests stream through the official `openai` AsyncOpenAI client. Load is either a fixed number of requests in
flight (--concurrency) or Poisson arrivals at --request-rate per second (still capped by --concurrency when
both are given). Prompts are random token-id lists on the completions endpoint (ignore_eos, so every request
makes exactly --output-len tokens) or the lines of --prompts (text completions, or chat with --chat).

--launch starts `bash run.sh --serve --weights DIR --config C --port P` itself, waits for /health, benches,
and stops it with SIGTERM. --offline-baseline then runs the same requests through the engine in-process
(`LLM(...).generate`, same checkpoint and preset, max_num_seqs capped at the concurrency) and prints the
server/offline output-throughput ratio. The default checkpoint is weights/deepseek-v4-bench (bench.py's,
written here if missing); the target is server/offline >= 0.85x at concurrency 16 on it.

--pd P:D benches PD disaggregation against colocated serving in one run: the same requests through `run.sh
--serve` and then through `run.sh --serve --pd P:D` (both launched here, one after the other), side by side with
PD / colocated ratios, and the KV transfer throughput (P's /pd/info: bytes written / seconds in the transfer
engine) against a plain memory copy of the same bytes per transfer and against the same writes between two idle
transfer engines, both timed here after the runs.
--long-input-len N --long-every K makes every K-th prompt N tokens long (a mixed workload: long prefills among
short ones, the decode stalls PD removes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from openai import AsyncOpenAI
from tqdm import tqdm

RECIPE = Path(__file__).resolve().parents[1]
BENCH = RECIPE.parents[1] / "weights" / "deepseek-v4-bench"  # = bench_utils.BENCH, without importing torch for it


@dataclass
class Result:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="OpenAI base URL (default http://127.0.0.1:PORT/v1)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, help="random token ids below this (default: the checkpoint's)")
    p.add_argument("--prompts", type=Path, help="one prompt per line instead of random token ids")
    p.add_argument("--chat", action="store_true", help="with --prompts: the chat completions endpoint")
    p.add_argument("--weights", type=Path, default=BENCH, help="checkpoint for --launch / --offline-baseline")
    p.add_argument("--config", type=Path, default=RECIPE / "configs" / "bench-cpu.yaml", help="deployment preset")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--launch", action="store_true", help="start the server (run.sh --serve) for the run")
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--offline-baseline", action="store_true", help="also run the requests offline, in-process")
    p.add_argument("--threads", type=int, help="torch threads (OMP_NUM_THREADS of a launched server too)")
    p.add_argument("--json", type=Path, help="write the numbers here")
    p.add_argument("--pd", help="P:D: bench `run.sh --serve --pd P:D` against colocated `run.sh --serve` (launched)")
    p.add_argument("--long-input-len", type=int, help="every --long-every-th prompt has this many tokens")
    p.add_argument("--long-every", type=int, default=4)
    p.add_argument("--token-chunks", action="store_true",
                   help="ask for log-probs so that every token streams as its own chunk (a per-token ITL; on by "
                        "default with --pd); otherwise a chunk may carry several tokens")
    a = p.parse_args(argv)
    if a.pd is not None:
        if not re.fullmatch(r"[1-9]\d*:[1-9]\d*", a.pd):
            p.error(f"--pd {a.pd!r}: expected P:D, e.g. 1:1")
        if a.offline_baseline:
            p.error("--pd compares against colocated serving; --offline-baseline is for one server")
        a.launch = a.token_chunks = True
    if a.long_input_len is not None and (a.long_input_len < 1 or a.long_every < 1 or a.prompts):
        p.error("--long-input-len / --long-every: positive, random token-id prompts only")
    if a.concurrency < 1 or a.num_prompts < 1 or a.input_len < 1 or a.output_len < 1:
        p.error("--concurrency, --num-prompts, --input-len and --output-len must be >= 1")
    if a.prompts is not None and not a.prompts.is_file():
        p.error(f"--prompts {a.prompts}: no such file")
    if a.chat and a.prompts is None:
        p.error("--chat needs --prompts")
    a.base_url = a.base_url or f"http://127.0.0.1:{a.port}/v1"
    return a


def ensure_checkpoint(path: Path) -> None:
    if path.resolve() == BENCH.resolve():
        import bench

        bench.ensure_bench()


def make_prompts(a) -> list[str | list[int]]:
    if a.prompts:
        lines = [line.strip() for line in a.prompts.read_text().splitlines() if line.strip()]
        return [lines[i % len(lines)] for i in range(a.num_prompts)]
    vocab = a.vocab_size
    if vocab is None:
        config = a.weights / "config.json"
        vocab = json.loads(config.read_text())["vocab_size"] if config.exists() else 16384
    rng = random.Random(a.seed)
    lengths = [a.long_input_len if a.long_input_len and i % a.long_every == a.long_every - 1 else a.input_len
               for i in range(a.num_prompts)]
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


async def one_request(client: AsyncOpenAI, a, prompt) -> Result:
    r = Result()
    kw = dict(model=a.model, max_tokens=a.output_len, temperature=0.0, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": not a.prompts})
    if a.token_chunks:  # a chunk per token (text held back for a partial character still comes with its log-prob)
        kw["logprobs"] = True if a.chat else 0
    t0 = last = time.perf_counter()
    try:
        if a.chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=prompt, **kw)
        chunks = 0
        async for chunk in stream:
            if chunk.usage:
                r.prompt_tokens, r.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            if not ((c.delta.content or "") if a.chat else c.text) and c.finish_reason is None and not a.token_chunks:
                continue
            now = time.perf_counter()
            if chunks == 0:
                r.ttft = now - t0
            else:
                r.itl.append(now - last)
            last, chunks = now, chunks + 1
        r.latency = time.perf_counter() - t0
        r.output_tokens = r.output_tokens or chunks  # no usage chunk: one token per chunk
        r.prompt_tokens = r.prompt_tokens or (len(prompt) if isinstance(prompt, list) else 0)
        r.ok = r.output_tokens > 0
    except Exception as e:  # noqa: BLE001 -- a failed request is counted, the run goes on
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_load(a, prompts) -> tuple[list[Result], float]:
    client = AsyncOpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=3600)
    if a.model is None:
        a.model = (await client.models.list()).data[0].id
    warm_a = argparse.Namespace(**{**vars(a), "output_len": 4})
    warm = await one_request(client, warm_a, prompts[0])
    if not warm.ok:
        raise SystemExit(f"warm-up request failed: {warm.error}")
    print(f"warm-up: ttft {warm.ttft * 1e3:.1f} ms, latency {warm.latency * 1e3:.1f} ms", flush=True)

    gate = asyncio.Semaphore(a.concurrency)
    arrivals = random.Random(a.seed + 1)

    progress = tqdm(total=len(prompts), desc="requests", unit="req", leave=False)

    async def gated(prompt):
        async with gate:
            result = await one_request(client, a, prompt)
        progress.update()
        return result

    tasks = []
    t0 = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(gated(prompt)))
        if math.isfinite(a.request_rate):
            await asyncio.sleep(arrivals.expovariate(a.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    progress.close()
    await client.close()
    return results, duration


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs, q: float(np.percentile(xs, q) * 1e3) if len(xs) else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
        "total_tok_s": (in_tokens + out_tokens) / duration,
        "ttft_ms_mean": float(np.mean(ttft) * 1e3) if ttft else float("nan"),
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "tpot_ms_mean": float(np.mean(tpot) * 1e3) if tpot else float("nan"),
        "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def print_table(title: str, s: dict) -> None:
    rows = [("completed / failed requests", f"{s['completed']} / {s['failed']}"),
            ("duration (s)", f"{s['duration_s']:.2f}"),
            ("request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("output tok/s", f"{s['output_tok_s']:.1f}"),
            ("total tok/s", f"{s['total_tok_s']:.1f}"),
            ("TTFT ms (mean / p50 / p99)", f"{s['ttft_ms_mean']:.1f} / {s['ttft_ms_p50']:.1f} / {s['ttft_ms_p99']:.1f}"),
            ("TPOT ms (mean / p50 / p99)", f"{s['tpot_ms_mean']:.1f} / {s['tpot_ms_p50']:.1f} / {s['tpot_ms_p99']:.1f}"),
            ("ITL ms (p50 / p99)", f"{s['itl_ms_p50']:.1f} / {s['itl_ms_p99']:.1f}")]
    print(f"\n{title}")
    for name, value in rows:
        print(f"  {name:<30}{value:>28}")
    for e in s["errors"]:
        print(f"  error: {e}")


def offline_baseline(a, prompts) -> dict:
    """The same requests through LLM.generate in this process: output and total tok/s."""
    import torch
    import yaml
    from transformers import AutoTokenizer

    from common import backend
    from common.engine import LLM, SamplingParams
    from encoding_deepseek_v4 import encode_messages
    from weights_deepseek_v4 import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    preset = yaml.safe_load(a.config.read_text()) or {}
    engine = dict(preset.get("engine") or {})
    engine["max_num_seqs"] = min(engine.get("max_num_seqs", a.concurrency), a.concurrency)
    dtype, _ = backend.resolve_dtype(None, preset.get("dtype"))  # as run.sh --serve resolves the preset's
    tok = AutoTokenizer.from_pretrained(a.weights)
    llm = LLM(load_model(a.weights, dtype, backend.device()), tok, **engine)
    if a.chat:
        prompts = [encode_messages([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=not a.prompts)
    # text as the server tokenizes it: completions add the BOS, a rendered chat prompt carries its own
    special = not a.chat
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
                 add_special_tokens=special)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, add_special_tokens=special)
    duration = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"duration_s": duration, "output_tokens": out_tokens, "prompt_tokens": in_tokens,
            "output_tok_s": out_tokens / duration, "total_tok_s": (in_tokens + out_tokens) / duration,
            "request_throughput": len(outs) / duration, "engine": engine}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before answering /health")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no /health from {url} after {timeout:.0f}s")


def launch(a, pd: str | None = None) -> subprocess.Popen:
    ensure_checkpoint(a.weights)
    cmd = ["bash", str(RECIPE / "run.sh"), "--serve", "--weights", str(a.weights), "--config", str(a.config),
           "--port", str(a.port)] + (["--pd", pd] if pd else [])
    if a.api_key and a.api_key != "EMPTY":
        cmd += ["--api-key", a.api_key]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(a.threads)} if a.threads else {})}
    print("launching: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{a.port}", proc, a.launch_timeout)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def memcpy_gb_s(nbytes: int, reps: int) -> float:
    """A plain memory copy of nbytes (torch, this process), reps times: GB/s."""
    import torch

    src, dst = torch.ones(max(1, nbytes), dtype=torch.uint8), torch.empty(max(1, nbytes), dtype=torch.uint8)
    dst.copy_(src)  # first touch
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def idle_transfer_gb_s(nbytes: int, num_writes: int, reps: int) -> float:
    """The same transfer between two idle Mooncake engines in this process (nbytes in num_writes equal writes, TCP
    on loopback), median of reps: GB/s."""
    import torch

    from common.kv_transfer import MooncakeTransport

    src, dst = torch.ones(max(1, nbytes), dtype=torch.uint8), torch.zeros(max(1, nbytes), dtype=torch.uint8)
    a_side, b_side = MooncakeTransport(), MooncakeTransport()
    a_side.register([(src.data_ptr(), src.numel())])
    b_side.register([(dst.data_ptr(), dst.numel())])
    step = src.numel() // max(1, num_writes)
    offsets = [i * step for i in range(max(1, num_writes))]
    lengths = [step] * (len(offsets) - 1) + [src.numel() - offsets[-1]]
    times = []
    for _ in range(reps + 1):  # the first connects
        t0 = time.perf_counter()
        a_side.write(b_side.address, [src.data_ptr() + o for o in offsets], [dst.data_ptr() + o for o in offsets],
                     lengths)
        times.append(time.perf_counter() - t0)
    return nbytes / sorted(times[1:])[reps // 2] / 1e9


def pd_main(a, prompts) -> int:
    """Colocated, then PD, with the same requests; the comparison and the transfer throughput."""
    runs, transfers = {}, None
    for mode in ("colocated", f"pd {a.pd}"):
        proc = launch(a, a.pd if mode != "colocated" else None)
        try:
            results, duration = asyncio.run(run_load(a, prompts))
            if mode != "colocated":  # the first prefill instance's transfer counters
                with urllib.request.urlopen(f"http://127.0.0.1:{a.port + 1}/pd/info", timeout=10) as r:
                    transfers = json.loads(r.read())["transfers"]
        finally:
            stop(proc)
        runs[mode] = summarize(results, duration)
        print_table(f"{mode}: {a.num_prompts} requests, concurrency {a.concurrency}", runs[mode])
    col, pd = runs.values()
    print(f"\nPD {a.pd} vs colocated (same requests; PD / colocated):")
    for key, name in [("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"), ("itl_ms_p50", "ITL p50 ms"),
                      ("itl_ms_p99", "ITL p99 ms"), ("tpot_ms_mean", "TPOT mean ms"), ("output_tok_s", "output tok/s")]:
        print(f"  {name:<16}{col[key]:>10.1f}{pd[key]:>10.1f}{pd[key] / col[key]:>9.2f}x")
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}, "runs": runs,
              "transfers": transfers}
    if transfers and transfers["num_transfers"]:
        per = transfers["bytes"] // transfers["num_transfers"]
        engine_gb_s = transfers["bytes"] / max(transfers["seconds"], 1e-9) / 1e9
        copy_gb_s = memcpy_gb_s(per, transfers["num_transfers"])
        writes = round(transfers["num_writes"] / transfers["num_transfers"])
        idle_gb_s = idle_transfer_gb_s(per, writes, 21)
        report.update(transfer_gb_s=engine_gb_s, memcpy_gb_s=copy_gb_s, idle_transfer_gb_s=idle_gb_s)
        print(f"\nKV transfer: {transfers['num_transfers']} requests, {transfers['bytes'] / 2**20:.1f} MiB in "
              f"{transfers['num_writes']} writes ({per / 2**20:.2f} MiB a request), {transfers['seconds']:.3f} s in "
              f"the transfer engine: {engine_gb_s:.2f} GB/s; memory copy of the same bytes here: {copy_gb_s:.2f} GB/s "
              f"(transfer / copy {engine_gb_s / copy_gb_s:.3f}x); the same {writes} writes between two idle "
              f"transfer engines here: {idle_gb_s:.2f} GB/s")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {a.json}")
    return 0 if col["failed"] == 0 and pd["failed"] == 0 else 1


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    from common.backend import cpu_description, cpu_model_name

    print(f"CPU: {cpu_model_name()} ({cpu_description()})", flush=True)
    if a.pd is not None:
        code = pd_main(a, make_prompts(a))
        print(f"bench wall time: {time.perf_counter() - t_start:.0f} s")
        return code
    if a.offline_baseline:
        ensure_checkpoint(a.weights)
    prompts = make_prompts(a)
    proc = launch(a) if a.launch else None
    try:
        results, duration = asyncio.run(run_load(a, prompts))
    finally:
        if proc is not None:
            stop(proc)  # before the offline run: the two would share the CPU
    load = (f"concurrency {a.concurrency}" + (f", {a.request_rate:g} req/s Poisson" if math.isfinite(a.request_rate) else ""))
    shape = f"{a.prompts.name} prompts" if a.prompts else f"input {a.input_len}, output {a.output_len} tokens"
    server = summarize(results, duration)
    print_table(f"server {a.base_url} model {a.model}: {a.num_prompts} requests, {shape}, {load}", server)
    args = {k: str(v) if isinstance(v, Path) else None if v == math.inf else v for k, v in vars(a).items()}
    report = {"args": args, "server": server}
    if a.offline_baseline:
        off = offline_baseline(a, prompts)
        ratio = server["output_tok_s"] / off["output_tok_s"]
        report["offline"], report["server_over_offline"] = off, ratio
        print(f"\noffline LLM.generate (max_num_seqs {off['engine']['max_num_seqs']}): "
              f"{off['output_tok_s']:.1f} output tok/s, {off['total_tok_s']:.1f} total tok/s in {off['duration_s']:.2f}s")
        print(f"server / offline output throughput: {ratio:.2f}x (target >= 0.85x)")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {a.json}")
    print(f"bench wall time: {time.perf_counter() - t_start:.0f} s")
    return 0 if server["failed"] == 0 else 1


if __name__ == "__main__":
    from common import cpu_malloc
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    sys.exit(main())
