"""DeepSeek-V4 vision: the encoder stage against timm, and what an image costs a request, side by side in one run.

    python bench/bench_vision.py [--weights DIR | --tower-layers N] [--sizes 448x448,896x672] [--repeats 5] [--threads 2]
                           [--dtype auto|bf16|fp32] [--quick]

DIR: a Vision-Exp-layout checkpoint. Without one, the bench writes (once) the tiny LLM with a vision tower of the
real one's width (1024 wide, 16 heads, SwiGLU 2816, patch 14, up to 1024 tokens an image) and --tower-layers of its
32 layers (weights/deepseek-v4-vision-bench-LN): an encode's time there is the real tower's per layer. Three tables:
1. Encode: ms per image through the vision tower + aligner (the recipe's `VisionEncoder.encode`, one image a call,
   best of --repeats) at each size, against timm's `deepseek_vit_412m_enc` built to the checkpoint's sizes and fed
   the same weights (timm's own checkpoint filter) and the same patches (timm imported through timm_import.py, which
   stands in for the torchvision names `import timm` reads where torchvision cannot load; where timm is not
   installed the row says why); the largest difference of the two outputs.
2. TTFT: one image request (a chat prompt with the image) against a text request of the same prompt length (random
   ids), through the engine with the prefix cache off: median time to the first token over --repeats, and the
   encoder stage's share of the image request's.
3. Repeated image: the same image request twice with the prefix cache on: tokens the second one found cached, its
   TTFT against the first one's, images encoded for it (0: its blocks came from the cache).
The last line: the ratios (ours / timm encode; image / text TTFT; repeated / first TTFT).
"""
from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm
from transformers import AutoTokenizer

from bench_utils import WEIGHTS
from chat_format_deepseek_v4 import DeepseekV4ChatFormat
from common import backend, cpu_malloc
from common.engine import LLMEngine, EngineConfig, SamplingParams
from common.loader import Checkpoint
from common.serving.chat_format import Conversation
from modeling_deepseek_vision import VisionArgs
from timm_import import import_timm
from tiny_deepseek_v4 import is_current, write_tiny_checkpoint
from weights_deepseek_v4 import load_model


def image_bytes(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.partition("x")
    if not (w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT, got {text!r}")
    return int(w), int(h)


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def timm_encoder(path: Path, args: VisionArgs, dtype: torch.dtype):
    """timm's deepseek_vit_412m_enc at the checkpoint's sizes with its vision tensors, or the reason it is not here."""
    try:
        timm = import_timm()  # with a stand-in for the torchvision names it reads, where torchvision cannot load
        from timm.models.deepseek_vit import checkpoint_filter_fn_encoder
    except (ImportError, RuntimeError, OSError) as e:
        return None, f"timm does not import here ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    ckpt = Checkpoint(path)
    model = timm.create_model("deepseek_vit_412m_enc", pretrained=False, embed_dim=args.hidden_size,
                              depth=args.num_hidden_layers, num_heads=args.num_attention_heads,
                              mlp_ratio=args.intermediate_size / args.hidden_size,
                              out_features=args.out_hidden_size).eval()
    state = {n: ckpt.get(n, torch.float32) for n in ckpt.names() if n.startswith(("vision.", "aligner."))}
    model.load_state_dict(checkpoint_filter_fn_encoder(state, model))
    return model.to(dtype), None


def ttft(engine: LLMEngine, prompt, repeats: int) -> tuple[float, float]:
    """Median seconds from add_request to the first token, and the median encoder-stage seconds of those runs."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, encoder = [], []
    for _ in range(repeats):
        before = engine.stats.encoder_time
        t0 = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
        encoder.append(engine.stats.encoder_time - before)
    return statistics.median(times), statistics.median(encoder)


# The real tower's sizes (modeling_deepseek_vision.VisionArgs' defaults, from the publisher's vision_config)
REAL_WIDTH = dict(hidden_size=1024, num_attention_heads=16, intermediate_size=2816, max_num_tokens=1024,
                  min_pixels=384 * 384)


def bench_tower(layers: int) -> Path:
    """The tiny LLM with a real-width vision tower of `layers` layers, written once."""
    path = WEIGHTS / f"deepseek-v4-vision-bench-l{layers}"
    if not is_current(path):
        print(f"writing {path} (a {layers}-layer real-width vision tower on the tiny LLM)", flush=True)
        write_tiny_checkpoint(path, seed=0, vision_config={**REAL_WIDTH, "num_hidden_layers": layers},
                              max_shard_bytes=2**30)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, help="a Vision-Exp-layout checkpoint (default: a real-width bench tower)")
    p.add_argument("--tower-layers", type=int, default=4, help="layers of the bench tower (the real one has 32)")
    p.add_argument("--sizes", default="448x448,896x672", help="image sizes WIDTHxHEIGHT, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=[backend.AUTO, *sorted(backend.DTYPES)], default=backend.AUTO)
    p.add_argument("--quick", action="store_true", help="one repeat, the first size only (a smoke run)")
    a = p.parse_args()
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if a.tower_layers < 1:
        p.error(f"--tower-layers {a.tower_layers}: must be >= 1")
    path = a.weights or bench_tower(a.tower_layers)
    if not (path / "config.json").exists():
        p.error(f"--weights {path}: no checkpoint there")
    config = Checkpoint(path).config
    if not config.get("vision_config"):
        p.error(f"--weights {path}: no vision_config: not a vision checkpoint")
    repeats, sizes = (1, sizes[:1]) if a.quick else (a.repeats, sizes)
    torch.set_num_threads(a.threads)
    dtype, line = backend.resolve_dtype(a.dtype, None)
    print(f"{line}; {backend.cpu_description()}; {a.threads} threads; {path.name}", flush=True)
    model = load_model(path, dtype, backend.device())
    tok = AutoTokenizer.from_pretrained(path)
    encoder = model.engine_contract().encoder
    reference, why = timm_encoder(path, model.vision_model.args, dtype)
    images = {size: image_bytes(*size, seed=i) for i, size in enumerate(sizes)}
    rows = []
    with tqdm(total=len(sizes) * 3, desc="bench_vision", unit="run") as bar, torch.inference_mode():
        for size, data in images.items():
            item = encoder.process(data)
            encoder.encode([item.data])  # warm-up
            ours = best_ms(lambda: encoder.encode([item.data]), repeats)
            theirs = diff = None
            if reference is not None:
                pixels, (h, w) = item.data
                x = pixels.view(h, w, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(1, 3, h * 14, w * 14).to(dtype)
                theirs = best_ms(lambda: reference(x), repeats)
                feats = model.vision_model.image_features([pixels], [(h, w)])[0]
                diff = (reference(x)[0].float() - feats.float()).abs().max().item()
            bar.update()
            rows.append((size, item.num_tokens, item.data[1], ours, theirs, diff))
        engine_kwargs = dict(block_size=16, max_num_batched_tokens=4096, max_num_encoder_input_tokens=4096,
                             kv_cache_memory_bytes=2**29)
        cold = LLMEngine(model, tok, EngineConfig(enable_prefix_caching=False, **engine_kwargs))
        warm_model = copy.deepcopy(model)  # an engine a model: the warm engines' caches are not the cold one's
        chat = DeepseekV4ChatFormat()
        vocab = model.args.vocab_size
        ttfts = []
        for i, (size, data) in enumerate(images.items()):
            prompt = chat.encode(Conversation([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Describe the image."}]}]))
            request = {"prompt": prompt.text, "multi_modal_data": {"image": [data]}}
            n = len(cold.make_request(request, SamplingParams()).prompt_token_ids)
            text = torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            text = [t if t != model.args.image_token_id else t - 1 for t in text]  # no placeholder among them
            ttft(cold, request, 1)  # warm-up of this length
            image_s, encoder_s = ttft(cold, request, repeats)
            text_s, _ = ttft(cold, text, repeats)
            bar.update()
            warm = LLMEngine(warm_model, tok, EngineConfig(enable_prefix_caching=True, **engine_kwargs))
            first_s, _ = ttft(warm, request, 1)
            encoded = warm.stats.encoder_images
            req = warm.make_request(request, SamplingParams(temperature=0, max_tokens=1))
            warm.add(req)
            t0 = time.perf_counter()
            while warm.has_unfinished():
                warm.step()
            again_s = time.perf_counter() - t0
            ttfts.append((size, n, image_s, encoder_s, text_s, first_s, again_s, req.num_cached_tokens,
                          warm.stats.encoder_images - encoded))
            bar.update()
    print("\n1. encode (vision tower + aligner, one image a call)")
    print(f"{'size':>10} {'tokens':>6} {'patches':>9} {'ours ms':>9} {'timm ms':>9} {'max |diff|':>10}")
    for size, tokens, grid, ours, theirs, diff in rows:
        print(f"{size[0]}x{size[1]:<5} {tokens:>6} {grid[0] * grid[1]:>9} {ours:>9.1f} "
              f"{theirs if theirs is not None else float('nan'):>9.1f} {diff if diff is not None else float('nan'):>10.2e}")
    if why:
        print(f"timm: {why}")
    print("\n2. TTFT, prefix cache off (median)  3. the same image request again, prefix cache on")
    print(f"{'size':>10} {'prompt':>6} {'image ms':>9} {'encoder':>8} {'text ms':>8} {'first ms':>9} {'again ms':>9} "
          f"{'cached':>7} {'encoded':>7}")
    for size, n, image_s, encoder_s, text_s, first_s, again_s, cached, encoded in ttfts:
        print(f"{size[0]}x{size[1]:<5} {n:>6} {1e3 * image_s:>9.1f} {encoder_s / image_s:>7.0%} {1e3 * text_s:>8.1f} "
              f"{1e3 * first_s:>9.1f} {1e3 * again_s:>9.1f} {cached:>7} {encoded:>7}")
    ratios = [f"encode ours/timm {rows[i][3] / rows[i][4]:.2f}x at {s[0]}x{s[1]}" for i, (s, *_) in enumerate(rows)
              if rows[i][4]]
    ratios += [f"TTFT image/text {t[2] / t[4]:.2f}x, repeated/first {t[6] / t[5]:.2f}x at {t[0][0]}x{t[0][1]}"
               for t in ttfts]
    print("ratios: " + "; ".join(ratios))


if __name__ == "__main__":
    cpu_malloc.reexec_with_tcmalloc()  # before any timing: glibc's malloc makes step times a lottery
    main()
