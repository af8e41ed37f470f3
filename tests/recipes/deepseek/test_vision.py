"""The DeepSeek-V4 vision tower, aligner and image processor: parity with timm's deepseek_vit_412m_enc on the same
random weights, packed == one image at a time, the NPU path (emulated), the processor's plan worked out by hand from
upstream's rules, and its refusals."""
import dataclasses
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from common import ops
from common.loader import save_checkpoint
from common.ops.emulator import TorchNpuEmulator
from image_processor_deepseek import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    IMAGE_TOKEN_ID,
    TEXT,
    DeepseekImageProcessor,
    ImageProcessorConfig,
    image_token_types,
    plan_image,
)
from modeling_deepseek_vision import VisionArgs, load_vision_model, random_vision_tensors, vision_enabled

TINY = VisionArgs(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=176,
                  out_hidden_size=96)
# patch grids (h, w): multiples of 3 and not, portrait, landscape, a single patch
GRIDS = [(5, 7), (3, 6), (7, 2), (4, 8), (1, 1)]
LLM_TENSORS = ("embed.weight", "norm.weight", "head.weight", "layers.0.ffn.gate.bias_vl")


def tiny_config(args: VisionArgs) -> dict:
    vision = dict(num_hidden_layers=args.num_hidden_layers, hidden_size=args.hidden_size,
                  num_attention_heads=args.num_attention_heads, intermediate_size=args.intermediate_size,
                  patch_size=args.patch_size, rope_theta=args.rope_theta, downsample_ratio=args.downsample_ratio,
                  max_num_tokens=1024, min_pixels=295936, max_wh_ratio=None)
    return {"image_token_id": IMAGE_TOKEN_ID, "text_config": {"hidden_size": args.out_hidden_size},
            "vision_config": vision}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A publisher-layout checkpoint: the vision tensors plus a few LLM tensors the vision loader must skip."""
    tensors = random_vision_tensors(TINY, seed=3, dtype=torch.float32)
    tensors |= {name: torch.randn(8, 96) for name in LLM_TENSORS}
    return save_checkpoint(tmp_path_factory.mktemp("vision"), tensors, tiny_config(TINY)), tensors


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_vision_model(checkpoint[0], torch.float32)


def images_and_patches(grids, p=14, seed=0):
    """Random normalised images [1, 3, h*p, w*p] and their row-major patches [h*w, 3, p, p]."""
    g = torch.Generator().manual_seed(seed)
    images = [torch.randn(1, 3, h * p, w * p, generator=g) for h, w in grids]
    patches = [x[0].reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)
               for x, (h, w) in zip(images, grids)]
    return images, patches


def test_loads_only_vision_tensors(model, checkpoint):
    assert model.args == TINY and vision_enabled(tiny_config(TINY))
    assert not vision_enabled({"vision_config": {"num_hidden_layers": 0}}) and not vision_enabled({})
    assert not set(LLM_TENSORS) & set(model.checkpoint_reads)
    torch.testing.assert_close(model.image_newline.data, checkpoint[1]["image_newline"])


def test_matches_timm_deepseek_vit_enc(model, checkpoint, tmp_path):
    """timm's deepseek_vit_412m_enc on the same tensors, in a process of its own (timm_deepseek_vit.py: where
    torchvision cannot import, `import timm` gets a stand-in for the torchvision names it reads at import)."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (requirements-nodeps.txt installs it)")
    images, patches = images_and_patches(GRIDS)
    save_file({k: v.contiguous() for k, v in checkpoint[1].items()}, tmp_path / "tensors.safetensors")
    (tmp_path / "dims.json").write_text(json.dumps(dataclasses.asdict(TINY)))
    save_file({str(i): x for i, x in enumerate(images)}, tmp_path / "images.safetensors")
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("timm_deepseek_vit.py"))]
                         + [str(tmp_path / f) for f in ("tensors.safetensors", "dims.json", "images.safetensors",
                                                        "out.safetensors")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = load_file(tmp_path / "out.safetensors")
    with torch.no_grad():
        got = model.image_features(patches, GRIDS)
    for i, (y, (h, w)) in enumerate(zip(got, GRIDS)):
        want = reference[str(i)]
        assert y.shape == want.shape == (-(-h // 3) * -(-w // 3), TINY.out_hidden_size)
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)


def test_packed_equals_one_image_at_a_time(model):
    _, patches = images_and_patches(GRIDS, seed=1)
    with torch.no_grad():
        packed = model.image_features(patches, GRIDS)
        for x, y, grid in zip(patches, packed, GRIDS):
            torch.testing.assert_close(y, model.image_features([x], [grid])[0], atol=1e-5, rtol=1e-5)


def test_encode_lays_out_the_placeholder_span(model):
    _, patches = images_and_patches(GRIDS[:2], seed=2)
    with torch.no_grad():
        features = model.image_features(patches, GRIDS[:2])
        spans = model.encode(patches, GRIDS[:2])
    for span, feats, (h, w) in zip(spans, features, GRIDS[:2]):
        types = torch.tensor(image_token_types(-(-h // 3), -(-w // 3)))
        assert span.shape == (len(types), TINY.out_hidden_size)
        torch.testing.assert_close(span[types == IMAGE], feats)  # aligner rows in reading order
        for kind, vector in ((IMAGE_START, model.image_start), (IMAGE_NEW_LINE, model.image_newline),
                             (IMAGE_END, model.image_end)):
            assert torch.equal(span[types == kind], vector.data.expand(int((types == kind).sum()), -1))


def test_npu_path_matches_reference_path(model):
    _, patches = images_and_patches(GRIDS, seed=4)
    with torch.no_grad():
        expected = model.image_features(patches, GRIDS)
        emulator = TorchNpuEmulator()
        previous = ops.use_backend("npu", emulator)
        try:
            got = model.image_features(patches, GRIDS)
        finally:
            ops.use_backend(previous)
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score", "npu_swiglu"} <= set(emulator.calls)
    for y, want in zip(got, expected):
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)


def test_bad_inputs_to_the_model(model):
    _, patches = images_and_patches([(2, 3)])
    with pytest.raises(ValueError, match="do not match grid 2x4"):
        model.image_features(patches, [(2, 4)])
    with pytest.raises(ValueError, match="1 pixel tensors but 2 grids"):
        model.image_features(patches, [(2, 3), (1, 1)])
    with pytest.raises(ValueError, match="head_dim 6 must be a multiple of 4"):
        VisionArgs(hidden_size=24, num_attention_heads=4)
    with pytest.raises(ValueError, match="no vision_config"):
        VisionArgs.from_config({"hidden_size": 8})


# ------------------------------------------------------------------ the image processor (defaults: p 14, r 3,
# max_num_tokens 1024, min_pixels 295936 = 544^2)

@pytest.mark.parametrize("size, max_wh_ratio, canvas, grid, llm_grid, tokens, letterbox", [
    # 544x544: area = min_pixels, no upscale; ceil(544/14) = 39 -> 546; ceil(39/3) = 13; 13 * 14 + 2
    ((544, 544), None, (546, 546), (39, 39), (13, 13), 184, True),
    # 100x50: area 5000 -> scale sqrt(295936/5000) = 7.6933: 769x384 -> 770x392 (55 x 28 patches); 10 x 19
    ((100, 50), None, (770, 392), (28, 55), (10, 19), 202, True),
    # 1000x100 with max_wh_ratio 2: width counts as 200, area 20000 -> scale 3.8467: 769x384, as above; stretched
    ((1000, 100), 2, (770, 392), (28, 55), (10, 19), 202, False),
    # 1000x1000: 72 x 72 patches (1008 px), 24 x 24 -> 24 * 25 + 2 = 602 <= 1024
    ((1000, 1000), None, (1008, 1008), (72, 72), (24, 24), 602, True),
    # 1920x1080: 138 x 78 patches cost 26 * 47 + 2 = 1224 > 1024; aspect 0.5625: max_w = sqrt(1022/0.5625 + 1/4)
    # - 1/2 = 42.13, max_h = 23.70; beta = min(42 * 42 / 1920, 23 * 42 / 1080) = 0.8944: 1080 -> 966, 1920 ->
    # floor(122.67) * 14 = 1708; 69 x 122 patches, 23 x 41 -> 968
    ((1920, 1080), None, (1708, 966), (69, 122), (23, 41), 968, True),
    # 1x5000: upscaled to 7x38466 (1834 tokens); max_w = sqrt(1022 / 5495.1 + 1/4) - 1/2 < 1: one column,
    # (1022 // 2) * 42 = 21462 high, 42 wide -> 511 x 1 -> 1024
    ((1, 5000), None, (42, 21462), (1533, 3), (511, 1), 1024, True),
    # 20000x1: upscaled to 76933x3 (1835 tokens); max_h < 1: one row, (1024 - 3) * 42 = 42882 wide -> 1 x 1021
    ((20000, 1), None, (42882, 42), (3, 3063), (1, 1021), 1024, True),
])
def test_plan_worked_examples(size, max_wh_ratio, canvas, grid, llm_grid, tokens, letterbox):
    plan = plan_image(*size, ImageProcessorConfig(max_wh_ratio=max_wh_ratio))
    assert ((plan.width, plan.height), plan.grid, plan.llm_grid) == (canvas, grid, llm_grid)
    assert (plan.num_tokens, plan.letterbox) == (tokens, letterbox)


def test_plan_stays_within_the_token_budget():
    cfg = ImageProcessorConfig(max_num_tokens=64, min_pixels=0)
    for w in (1, 13, 14, 15, 99, 640, 3001, 9999):
        for h in (1, 7, 28, 300, 1111, 7777):
            plan = plan_image(w, h, cfg)
            assert 4 <= plan.num_tokens <= 64 and plan.width % 14 == plan.height % 14 == 0


def test_letterbox_pixels_and_patch_order():
    # 20x10 red: 2:1 like 100x50 -> canvas 770x392; content 770 x round(10/20 * 770) = 385 rows, pasted at
    # row round((392 - 385) / 2) = 4; gray 127 -> (127/255 - 0.5) / 0.5 above and below
    out = DeepseekImageProcessor(dtype=torch.float32)(Image.new("RGB", (20, 10), (255, 0, 0)))
    assert out.grid == (28, 55) and out.pixel_values.shape == (28 * 55, 3, 14, 14)
    canvas = out.pixel_values.view(28, 55, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 392, 770)
    gray = float((torch.tensor(127.0) / 255 - 0.5) / 0.5)  # in fp32, as the processor computes it
    assert torch.equal(canvas[:, :4], torch.full((3, 4, 770), gray))
    assert torch.equal(canvas[:, 389:], torch.full((3, 3, 770), gray))
    red = torch.tensor([1.0, -1.0, -1.0])[:, None, None].expand(3, 385, 770)
    assert torch.equal(canvas[:, 4:389], red)
    assert out.token_types.tolist() == image_token_types(10, 19) and out.num_tokens == 202


def test_stretch_beyond_max_wh_ratio():
    # 1000x100 blue with max_wh_ratio 2: resized onto the whole 770x392 canvas, no gray anywhere
    processor = DeepseekImageProcessor(ImageProcessorConfig(max_wh_ratio=2), dtype=torch.float32)
    out = processor(Image.new("RGB", (1000, 100), (0, 0, 255)))
    assert out.grid == (28, 55) and not out.plan.letterbox
    assert torch.equal(out.pixel_values, torch.tensor([-1.0, -1.0, 1.0])[None, :, None, None].expand_as(out.pixel_values))


def test_encoded_bytes_and_modes():
    buf = io.BytesIO()
    Image.new("L", (30, 30), 255).save(buf, format="PNG")
    out = DeepseekImageProcessor()(buf.getvalue())
    assert out.pixel_values.dtype == torch.bfloat16 and out.grid == (39, 39)  # 900 px scaled to ~544x544 -> 39 x 39 patches
    assert bool((out.pixel_values == 1).all())  # white, on a canvas of its own aspect: no padding


def test_expand_placeholders():
    processor = DeepseekImageProcessor.from_config(tiny_config(TINY))
    assert processor.config == ImageProcessorConfig() and processor.image_token_id == IMAGE_TOKEN_ID
    small = processor(Image.new("RGB", (544, 544)))  # 13 x 13 -> 184 tokens
    wide = processor(Image.new("RGB", (100, 50)))  # 10 x 19 -> 202 tokens
    prompt = [5, IMAGE_TOKEN_ID, 6, 7, IMAGE_TOKEN_ID, 8]
    ids, types = processor.expand_placeholders(prompt, [small, wide])
    assert len(ids) == len(types) == 4 + 184 + 202
    assert ids[:1] == [5] and ids[185:187] == [6, 7] and ids[-1] == 8
    assert ids[1:185] == [IMAGE_TOKEN_ID] * 184 and ids[187:389] == [IMAGE_TOKEN_ID] * 202
    assert types[1:185] == [IMAGE_START] + ([IMAGE] * 13 + [IMAGE_NEW_LINE]) * 13 + [IMAGE_END]
    assert types[187:389] == [IMAGE_START] + ([IMAGE] * 19 + [IMAGE_NEW_LINE]) * 10 + [IMAGE_END]
    assert [types[0], types[185], types[186], types[-1]] == [TEXT] * 4
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        processor.expand_placeholders(prompt, [small])


def test_refusals():
    processor = DeepseekImageProcessor()
    with pytest.raises(ValueError, match=r"zero size \(0x5\)"):
        processor(Image.new("RGB", (0, 5)))
    with pytest.raises(ValueError, match="more than the 1000 allowed"):
        DeepseekImageProcessor(ImageProcessorConfig(max_input_pixels=1000))(Image.new("RGB", (50, 50)))
    with pytest.raises(ValueError, match="mode 'La' cannot be converted to RGB"):
        processor(Image.new("La", (4, 4)))
    with pytest.raises(ValueError, match="cannot decode image"):
        processor(b"not an image")
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, format="PNG")
    with pytest.raises(ValueError, match="cannot decode image"):
        processor(buf.getvalue()[:60])  # truncated: the header reads, the pixels do not
    # 1x100000: one column, canvas 42x21462; the image would be round(1/100000 * 21462) = 0 pixels wide
    with pytest.raises(ValueError, match="aspect ratio 1:100000 is too extreme"):
        processor(Image.new("RGB", (1, 100000)))
    with pytest.raises(ValueError, match="max_num_tokens 3 < 4"):
        ImageProcessorConfig(max_num_tokens=3)
