"""bf16 against fp32 GEMMs on this CPU and on the CPU kinds oneDNN / ATen can simulate: what backend.default_dtype()
decides from. A maintenance tool (README "CPU dtype"), not a test.

    python scripts/cpu_dtype_probe.py [--kinds native,avx512_core,avx2] [--threads 1] [--reps 5] [--quick]

Each kind runs in its own process with the environment set before torch starts:
- native: as the machine is;
- avx512_core: ONEDNN_MAX_CPU_ISA=AVX512_CORE (AVX-512 without bf16 instructions: oneDNN emulates bf16);
- avx2: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (an AVX2-only CPU: no oneDNN bf16 kernels).
fp32 GEMMs go to MKL, which neither variable limits (nor MKL_ENABLE_INSTRUCTIONS on an AMD CPU), so a simulated
kind's fp32 column is this CPU's: on a real AVX2 part, with half the vector width, expect up to ~2x less.

Workloads: the weight GEMMs of the recipes' bench models, each GEMM shape timed alone (best of --reps; cycling over
copies of its weight that outgrow the last-level cache, as a step that reads every weight once does) and summed
with its count per step, in four ways: fp32; bf16 (F.linear on bf16, what the DiTs run); bf16 packed (the weight in
oneDNN's blocked layout, what common/cpu_gemm gives the deepseek engine; only where oneDNN has bf16 kernels); bf16
storage with fp32 compute (weights kept bf16, upcast in every GEMM). The shapes:
- deepseek: recipes/deepseek/bench/bench.py's model (hidden 1024, 8 layers, 12 experts top-2), every nn.Linear, the
  router, the grouped o-projection and the routed experts (tokens spread evenly), for a decode step of 1 and of 16
  sequences and a 512-token prefill chunk (logits of its last token only);
- hunyuan-video / magihuman: the GEMMs one forward of the bench DiT issues at the bench's size, recorded from the
  recipe's own model (fp32, random weights);
- square: one 1024^3 [M, K] @ [K, N] product, the kind of "matmul peak" the diffusion benches used to measure.
Prints progress on stderr, then a markdown table (ms per step or forward, GFLOP/s in brackets). One thread by
default, timed in the thread's CPU time: the dtype comparison, not the machine's peak, and robust on a shared host.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = {"native": {}, "avx512_core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
         "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
MODES = ("fp32", "bf16", "bf16 packed", "bf16 weights, fp32 compute")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- workloads: lists of [M, N, K, count, kind]; kind "w": x [M, K] @ W[N, K].T (a weight), "a": [M, K] @ [K, N] --
def deepseek_workloads() -> dict[str, list]:
    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT / "recipes" / "deepseek"))
    from bench import BENCH_CONFIG
    from config_deepseek_v4 import ModelArgs
    from modeling_deepseek_v4 import DeepseekV4

    args = ModelArgs.from_config(dict(BENCH_CONFIG))
    with torch.device("meta"):
        model = DeepseekV4(args)
    linears, experts = Counter(), Counter()  # (N, K) -> count per step
    for name, mod in model.named_modules():
        if name.endswith("wo_a"):  # grouped over o_groups: G products [T, I] @ [I, R], weight [G * R, I]
            g = args.o_groups
            linears[(mod.weight.shape[0] // g, mod.weight.shape[1], "g")] += g
        elif isinstance(mod, nn.Linear) and name != "head":
            linears[(mod.out_features, mod.in_features, "w")] += 1
    for name, p in model.named_parameters():
        if name.endswith("gate.weight"):
            linears[(p.shape[0], p.shape[1], "w")] += 1
        elif name.endswith(("experts.w13", "experts.w2")):
            experts[(p.shape[1], p.shape[2])] += 1
    E, k = args.n_routed_experts, args.num_experts_per_tok
    out = {}
    for label, tokens, head_rows in (("deepseek decode, batch 1", 1, 1), ("deepseek decode, batch 16", 16, 16),
                                     ("deepseek prefill chunk, 512 tokens", 512, 1)):
        rows = [[tokens, n, kk, c, "w"] for (n, kk, _), c in linears.items()]
        rows.append([head_rows, args.vocab_size, args.hidden_size, 1, "w"])
        active, assigned = min(E, tokens * k), tokens * k  # routed tokens spread evenly over the experts they reach
        per = [assigned // active + (i < assigned % active) for i in range(active)]
        for (n, kk), layers in experts.items():
            for m, c in Counter(per).items():
                rows.append([m, n, kk, c * layers, "w"])
        out[label] = rows
    del sys.modules["bench"]
    sys.path.pop(0)
    return out


def record_gemms(model, run) -> list:
    """The [M, N, K] of every mm / addmm / bmm one call of `run` issues, weights told apart from activations."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "linear":  # torch 2.13 dispatches aten.linear whole: x [..., K], W [N, K]
                x, w = args[0], args[1]
                seen[(x.numel() // x.shape[-1], w.shape[0], w.shape[1], "w")] += 1
            elif name in ("mm", "addmm", "bmm", "baddbmm", "matmul"):
                a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
                batch = a.shape[0] if a.dim() == 3 else 1
                M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
                kind = "w" if b.untyped_storage().data_ptr() in weights else "a"
                seen[(M, N, K, kind)] += batch
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Record():
        run()
    return [[M, N, K, c, kind] for (M, N, K, kind), c in seen.items()]


def hunyuan_video_workload() -> list:
    import torch

    sys.path.insert(0, str(ROOT / "recipes" / "hunyuan-video"))
    import bench as hv

    model = hv.HunyuanVideoTransformer3D(hv.BENCH_CONFIG).eval()
    x = {k: v.float() if v.is_floating_point() else v for k, v in hv.inputs(hv.BENCH_CONFIG).items()}
    rows = record_gemms(model, lambda: model(**x))
    del sys.modules["bench"]
    sys.path.pop(0)
    torch.manual_seed(0)
    return rows


def magihuman_workload() -> list:
    import torch

    sys.path.insert(0, str(ROOT / "recipes" / "magihuman"))
    from bench import BENCH_CONFIG
    from config_magihuman import MagiHumanConfig
    from modeling_magihuman import MagiHumanDiT, build_inputs
    from pipeline_magihuman import latent_shape

    c = MagiHumanConfig.for_variant("distill", **BENCH_CONFIG)
    model = MagiHumanDiT(c, torch.float32).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    A, T, h, w = latent_shape(1.0, 128, 128)  # the bench's default clip: 1 s at 128x128
    text_len = 44  # the bench prompt's tokens: 182 DiT tokens = 7 x 4 x 4 video + 26 audio + 44 text
    inp = build_inputs(c, (T, h // 2, w // 2), A, text_len)
    video, audio, text = torch.randn(48, T, h, w), torch.randn(A, 64), torch.randn(text_len, c.text_in_channels)
    rows = record_gemms(model, lambda: model.velocity(video, audio, text, inp))
    del sys.modules["bench"]
    sys.path.pop(0)
    return rows


def workloads(quick: bool) -> dict[str, list]:
    out = deepseek_workloads()
    log("  shapes: deepseek done; recording the hunyuan-video DiT forward")
    out["hunyuan-video DiT forward (bench size)"] = hunyuan_video_workload()
    log("  shapes: recording the magihuman DiT forward")
    out["magihuman DiT forward (bench size)"] = magihuman_workload()
    n = 512 if quick else 1024
    out[f"square {n}^3 [M,K] @ [K,N]"] = [[n, n, n, 1, "a"]]
    return out


# -- measuring (in the child process, with the kind's environment) ------------------------------------------------
CLOCK = time.perf_counter  # child() switches to time.thread_time with one thread
COLD_BYTES = 96 * 2**20  # fp32 weight bytes cycled per shape: 3x this VM's 32 MiB L3


def best_seconds(fn, reps: int) -> float:
    """Best of `reps` samples of fn's time; a sample repeats fn to >= ~20 ms so that tiny GEMMs time well."""
    fn()
    once = math.inf
    for _ in range(2):
        start = CLOCK()
        fn()
        once = min(once, CLOCK() - start)
    inner = max(1, min(500, int(0.02 / max(once, 1e-7))))
    best = math.inf
    for _ in range(reps):
        start = CLOCK()
        for _ in range(inner):
            fn()
        best = min(best, (CLOCK() - start) / inner)
    return best


def measure(rows: list, reps: int, packed_ok: bool) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from common import cpu_gemm

    totals = dict.fromkeys(MODES, 0.0)
    g = torch.Generator().manual_seed(0)
    for M, N, K, count, kind in rows:
        x32 = torch.randn(M, K, generator=g)
        if kind == "a":
            b32 = torch.randn(K, N, generator=g)
            b16, x16 = b32.bfloat16(), x32.bfloat16()
            t32 = best_seconds(lambda: x32 @ b32, reps)
            t16 = best_seconds(lambda: x16 @ b16, reps)
            times = {"fp32": t32, "bf16": t16, "bf16 packed": math.nan, "bf16 weights, fp32 compute": t32}
        else:  # distinct weights in turn, more bytes than the last-level cache: a step reads each weight once
            copies = max(1, min(64, -(-COLD_BYTES // (N * K * 4))))
            w32 = [torch.randn(N, K, generator=g) * K**-0.5 for _ in range(copies)]
            w16, x16 = [w.bfloat16() for w in w32], x32.bfloat16()
            c32, c16 = itertools.cycle(w32), itertools.cycle(w16)
            times = {"fp32": best_seconds(lambda: F.linear(x32, next(c32)), reps),
                     "bf16": best_seconds(lambda: F.linear(x16, next(c16)), reps),
                     "bf16 weights, fp32 compute": best_seconds(lambda: F.linear(x32, next(c16).float()), reps)}
            if packed_ok:
                cp = itertools.cycle([cpu_gemm.pack(w) for w in w16])
                times["bf16 packed"] = best_seconds(lambda: cpu_gemm.linear(x16, next(cp)), reps)
            else:
                times["bf16 packed"] = math.nan
            del w32, w16, c32, c16
        for mode in MODES:
            totals[mode] += count * times[mode]
    return totals


def child(args) -> None:
    import torch

    from common import backend

    global CLOCK
    torch.set_num_threads(args.threads)
    CLOCK = time.thread_time if args.threads == 1 else time.perf_counter
    rows = json.loads(Path(args.child).read_text())
    kind = backend.cpu_bf16_kind()
    packed_ok = kind != "none"
    result = {"kind": kind, "describe": backend.describe_dtype_choice(backend.default_dtype()),
              "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
              "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              "workloads": {}}
    for name, shapes in rows.items():
        start = time.perf_counter()
        totals = measure(shapes, args.reps, packed_ok)
        flops = sum(2 * M * N * K * c for M, N, K, c, _ in shapes)
        result["workloads"][name] = {"flops": flops, "seconds": totals}
        log(f"  [{args.kind}] {name}: " + ", ".join(f"{m} {t * 1e3:.2f} ms" for m, t in totals.items() if t == t)
            + f"  ({time.perf_counter() - start:.0f} s)")
    print(json.dumps(result))


# -- the table ------------------------------------------------------------------------------------------------------
def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                keep = [f for f in flags if f.startswith(("avx", "amx", "fma")) or f in ("f16c",)]
                return " ".join(keep)
    except OSError:
        pass
    return "?"


def table(results: dict, threads: int) -> str:
    clock = "thread CPU time" if threads == 1 else "wall time"
    from common import backend

    lines = [f"CPU: {backend.cpu_model_name()}; flags: {cpu_flags()}; torch {__import__('torch').__version__}; {threads} "
             f"thread(s), {clock}, best of the reps per GEMM; ms per step / forward (GFLOP/s)",
             "", "| workload | CPU kind | " + " | ".join(MODES) + " | fastest |",
             "|---|---|" + "---|" * (len(MODES) + 1)]
    names = next(iter(results.values()))["workloads"]
    for name in names:
        for kind, res in results.items():
            w = res["workloads"][name]
            cells, valid = [], {}
            for mode in MODES:
                t = w["seconds"][mode]
                if t != t:  # nan: not run
                    cells.append("-")
                    continue
                valid[mode] = t
                cells.append(f"{t * 1e3:.2f} ms ({w['flops'] / t / 1e9:.0f})")
            fastest = min(valid, key=valid.get)
            lines.append(f"| {name} | {kind} ({res['kind']}) | " + " | ".join(cells) + f" | {fastest} |")
    lines.append("")
    for kind, res in results.items():
        env = " ".join(f"{k}={v}" for k, v in KINDS[kind].items()) or "no variables"
        lines.append(f"- {kind} ({env}): cpu_bf16_kind() = {res['kind']}, _is_mkldnn_bf16_supported() = "
                     f"{res['mkldnn_bf16']}, ATen capability {res['capability']}; {res['describe']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {sorted(KINDS)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, timed in the thread's CPU "
                   "time, which other processes on a shared machine do not inflate; N > 1: wall time)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2 reps, a 512^3 square (a smoke run)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a JSON file of workloads: measure them, print JSON
    p.add_argument("--kind", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.reps = 2
    if args.child:
        child(args)
        return 0
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"--kinds: unknown {sorted(unknown)}, expected of {sorted(KINDS)}")
    log("recording the workloads' GEMM shapes")
    shapes = workloads(args.quick)
    for name, rows in shapes.items():
        log(f"  {name}: {sum(r[3] for r in rows)} GEMMs, {len(rows)} distinct shapes, "
            f"{sum(2 * M * N * K * c for M, N, K, c, _ in rows) / 1e9:.2f} GFLOP")
    spec = Path(os.environ.get("TMPDIR", "/tmp")) / f"cpu_dtype_probe_{os.getpid()}.json"
    spec.write_text(json.dumps(shapes))
    results = {}
    try:
        for kind in kinds:
            env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                                                                     "ATEN_CPU_CAPABILITY")}
            env.update(KINDS[kind])
            log(f"measuring {kind} ({' '.join(f'{k}={v}' for k, v in KINDS[kind].items()) or 'no variables'})")
            start = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, "--child", str(spec), "--kind", kind, "--threads",
                                str(args.threads), "--reps", str(args.reps)], env=env, stdout=subprocess.PIPE,
                               text=True)
            if r.returncode:
                log(f"  {kind}: the measuring process failed (exit {r.returncode})")
                return 1
            results[kind] = json.loads(r.stdout.strip().splitlines()[-1])
            log(f"  {kind}: {time.perf_counter() - start:.0f} s")
    finally:
        spec.unlink(missing_ok=True)
    print(table(results, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
