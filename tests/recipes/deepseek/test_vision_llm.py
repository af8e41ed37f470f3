"""The LLM side of DeepSeek-V4 vision (Vision-Exp layout): the tiny writer's checkpoint, text-only forwards unchanged
bit for bit by the vision part, image embeddings over their placeholder rows, and `bias_vl` routing of image tokens
against upstream's rule written out."""
import io
import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoTokenizer

from common import ops
from common.engine import ForwardBatch
from common.engine.model_runner import bind_new_caches, prefill_logits
from common.engine.multimodal import expand_placeholders
from common.loader import Checkpoint
from config_deepseek_v4 import ModelArgs
from image_processor_deepseek import IMAGE_TOKEN
from tiny_deepseek_v4 import REVISION_FILE, TINY_REVISION, is_current, write_tiny_checkpoint
from weights_deepseek_v4 import load_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-llm")
    return (write_tiny_checkpoint(root / "vision", seed=5, quantized=False),
            write_tiny_checkpoint(root / "text", seed=5, quantized=False, vision=False))


@pytest.fixture(scope="module")
def models(checkpoints):
    return tuple(load_model(path, torch.float32) for path in checkpoints)


def png(size=(100, 70), color=(200, 30, 90)) -> bytes:
    g = torch.Generator().manual_seed(sum(color))
    pixels = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    pixels[..., 0] = color[0]
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def test_tiny_checkpoint_has_the_vision_exp_layout(checkpoints):
    vision, text = (Checkpoint(p) for p in checkpoints)
    config = vision.config
    assert config["vision_config"]["num_hidden_layers"] >= 1 and "vision_config" not in text.config
    tok = AutoTokenizer.from_pretrained(checkpoints[0])
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == config["image_token_id"]
    assert tok(f"a{IMAGE_TOKEN}b", add_special_tokens=False).input_ids.count(config["image_token_id"]) == 1
    names = set(vision.names())
    args = ModelArgs.from_config(config)
    assert {"vision.patch_embed.proj.weight", "vision.norm.weight", "aligner.w1.weight", "aligner.w2.bias",
            "image_start", "image_end", "image_newline"} <= names
    assert all(f"layers.{i}.ffn.gate.bias_vl" in names for i in range(args.num_hidden_layers))
    assert {n for n in names if not n.startswith(("vision.", "aligner.", "image_")) and "bias_vl" not in n} \
        == set(text.names())  # the LLM's tensors, and the same ones, in both layouts
    for name in text.names():
        assert torch.equal(vision.get(name), text.get(name)), name


def test_an_older_tiny_revision_is_rewritten(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "t", seed=0, quantized="bf16")
    assert is_current(path)
    (path / REVISION_FILE).write_text(f"{TINY_REVISION - 1}\n")
    assert not is_current(path)


def test_text_only_forwards_are_bit_identical_to_the_text_model(models):
    vision, text = models
    assert vision.engine_contract().encoder is not None and text.engine_contract().encoder is None
    prompts = [[0, 2, 50, 61, 99, 300, 7, 3], list(range(10, 47))]
    assert torch.equal(prefill_logits(vision, prompts), prefill_logits(text, prompts))


def image_prompt(model, images, before=(0, 2, 50, 61), after=(77, 3)):
    """Ids with one placeholder per image between `before` and `after`, expanded; and the placed inputs."""
    encoder = model.engine_contract().encoder
    items = [encoder.process(im) for im in images]
    ids = [*before, *([encoder.placeholder_token_id] * len(items)), *after]
    return expand_placeholders(ids, items, encoder.placeholder_token_id)


def forward_with_images(model, ids, placed) -> torch.Tensor:
    """Logits [T, V] of one prompt, the images' embeddings over their rows."""
    encoder = model.engine_contract().encoder
    embeds = encoder.encode([mm.data for mm in placed])
    rows = torch.cat([torch.arange(mm.offset, mm.end) for mm in placed])
    groups = [g.name for g in model.cache_specs(16)]
    batch, num_blocks = ForwardBatch.prefill([ids], groups, 16)
    batch.mm_rows, batch.mm_embeds = rows, torch.cat(embeds)
    bind_new_caches(model, dict.fromkeys(groups, num_blocks), 16)
    with torch.no_grad():
        return model.compute_logits(model(batch))


def test_image_embeddings_replace_their_placeholder_rows(models):
    model = models[0]
    a, b = png(color=(200, 30, 90)), png(color=(10, 250, 40))
    ids, placed = image_prompt(model, [a])
    (mm,) = placed
    logits = forward_with_images(model, ids, placed)
    # causal: the text before the image is the text-only prompt's (another length: other GEMM blockings, 1e-4)
    torch.testing.assert_close(logits[: mm.offset], prefill_logits(model, [ids[: mm.offset]]), atol=1e-4, rtol=1e-4)
    assert torch.equal(forward_with_images(model, ids, placed), logits)  # the same image: the same logits
    ids_b, placed_b = image_prompt(model, [b])
    assert ids_b == ids and placed_b[0].identifier != mm.identifier  # same placeholder ids, another image
    assert not torch.allclose(forward_with_images(model, ids_b, placed_b)[mm.offset:], logits[mm.offset:])
    # without the embeddings the placeholder rows are the token's own embedding: a different forward
    assert not torch.allclose(prefill_logits(model, [ids])[mm.offset:], logits[mm.offset:])


@pytest.mark.parametrize("layer", [0, 1], ids=["hash-layer", "topk-layer"])
def test_bias_vl_routes_image_tokens_as_upstream(models, layer):
    """MoE output for a mix of text and image rows against upstream's rule written out: image rows pick top-k of
    scores + bias_vl (hash layers included), weights the unbiased scores renormalised x routed_scaling_factor; text
    rows route as before (bias / tid2eid)."""
    model = models[0]
    moe, a = model.layers[layer].ffn, model.args
    g = torch.Generator().manual_seed(layer)
    x = torch.randn(9, a.hidden_size, generator=g)
    input_ids = torch.randint(10, 400, (9,), generator=g)
    image = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    input_ids[image] = a.image_token_id
    with torch.no_grad():
        got = moe(x, input_ids, image_mask=image)
        text_only = moe(x, input_ids)
        scores = F.softplus(x @ moe.gate.weight.T).sqrt()  # [T, E] sqrtsoftplus
        if moe.hash:
            text_idx = moe.gate.tid2eid[input_ids].long()
        else:
            text_idx = (scores + moe.gate.bias).topk(a.num_experts_per_tok, -1).indices
        image_idx = (scores + moe.gate.bias_vl).topk(a.num_experts_per_tok, -1).indices
        idx = torch.where(image[:, None], image_idx, text_idx)
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) * a.routed_scaling_factor
        w13, w2 = moe.experts.w13, moe.experts.w2
        want = moe.shared_experts(x)
        for t in range(9):
            for j in range(a.num_experts_per_tok):
                e = idx[t, j]
                want[t] += w[t, j] * (w2[e] @ ops.swiglu(w13[e] @ x[t], a.swiglu_limit))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # text rows: routed as without the image rows beside them (the expert groups' sizes differ: GEMM blockings)
    torch.testing.assert_close(got[~image], text_only[~image], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(got[image], text_only[image])  # the tiny bias_vl picks other experts


def test_mtp_blocks_carry_no_bias_vl(checkpoints):
    model = load_model(checkpoints[0], torch.float32, mtp=True)
    assert all(block.ffn.gate.bias_vl is None for block in model.mtp)
    assert all(layer.ffn.gate.bias_vl is not None for layer in model.layers)


def test_vision_config_needs_the_image_token():
    config = json.loads(json.dumps({"vocab_size": 512, "vision_config": {"num_hidden_layers": 1}}))
    with pytest.raises(ValueError, match="image_token_id"):
        ModelArgs.from_config(config)
