"""Scheduler sigmas, resolution buckets, the text-to-image / CFG sequence and the mask."""
import pytest
import torch

from scheduler_hunyuan_image import make_scheduler
from sequence_hunyuan_image import attention_mask, build_sequence, ratio_prompt, resolution_buckets, snap_resolution


def test_scheduler_sigmas_are_the_spec_values():
    sched = make_scheduler(50)
    sigmas = sched.sigmas.double()
    assert len(sigmas) == 51 and len(sched.timesteps) == 50
    torch.testing.assert_close(sigmas[:4], torch.tensor([1.0, 0.9932, 0.9863, 0.9792], dtype=torch.float64),
                               rtol=0, atol=5e-5)  # the spec's 4-digit values
    torch.testing.assert_close(sigmas[-3:], torch.tensor([0.1111, 0.0577, 0.0], dtype=torch.float64), rtol=0, atol=5e-5)
    s = torch.linspace(1, 0, 51, dtype=torch.float64)
    torch.testing.assert_close(sigmas, 3 * s / (1 + 2 * s), rtol=0, atol=1e-6)  # shift 3, float32 storage
    torch.testing.assert_close(sched.timesteps.double(), 1000 * sigmas[:-1], rtol=0, atol=1e-3)


def test_scheduler_step_is_euler():
    sched = make_scheduler(4)
    x, v = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    out = sched.step(v, sched.timesteps[0], x).prev_sample
    torch.testing.assert_close(out, x + (sched.sigmas[1] - sched.sigmas[0]) * v)


def test_resolution_buckets():
    buckets = resolution_buckets(1024, 64)
    assert len(buckets) == 33 and len(set(buckets)) == 33
    assert buckets[0] == (512, 2048) and buckets[16] == (1024, 1024) and buckets[32] == (2048, 512)
    ratios = [h / w for h, w in buckets]
    assert ratios == sorted(ratios)
    assert all(h % 64 == 0 and w % 64 == 0 and 512 <= min(h, w) and max(h, w) <= 2048 for h, w in buckets)
    assert snap_resolution(1024, 1024) == (16, (1024, 1024))
    assert snap_resolution(500, 2100)[0] == 0 and snap_resolution(4000, 100)[0] == 32
    k, (h, w) = snap_resolution(768, 1280)
    assert min(abs(r - 768 / 1280) for r in ratios) == abs(h / w - 768 / 1280)


def test_cfg_sequence(tokenizer, special):
    prompt = "a red cat on the mat"
    seq = build_sequence(tokenizer, special, prompt, ratio_index=5, h=2, w=3, cfg=True, system_prompt="draw well")
    cond, uncond = seq.input_ids.tolist()
    system = tokenizer.encode("draw well", add_special_tokens=False)
    user = tokenizer.encode(prompt, add_special_tokens=False)
    tail = [special[k] for k in ("boi", "size", "ratio_5", "timestep")] + [special["img"]] * 6 + [special["eoi"]]
    assert cond == [special["bos"], *system, *user, *tail]
    assert uncond == [special["bos"], *system, *[special["cfg"]] * len(user), *tail]
    assert seq.image_start == 1 + len(system) + len(user) + 4 and seq.image_end == seq.image_start + 6
    assert cond[seq.timestep_pos] == special["timestep"] and cond[seq.image_end] == special["eoi"]
    single = build_sequence(tokenizer, special, prompt, 5, 2, 3, cfg=False, system_prompt="draw well")
    assert single.input_ids.tolist() == [cond]
    assert ratio_prompt(tokenizer, special, prompt, "draw well").tolist() == cond[:seq.image_start - 2]


@pytest.mark.parametrize("L, i0, i1", [(12, 5, 11), (9, 3, 7)])
def test_mask_semantics(L, i0, i1):
    m = attention_mask(L, i0, i1)
    for q in range(L):
        for k in range(L):
            image_q, image_k = i0 <= q < i1, i0 <= k < i1
            assert m[q, k] == (k <= q or (image_q and image_k)), (q, k)
    assert not m[i0 - 1, i0:i1].any()  # <timestep> does not see the image
    assert not m[i0:i1, i1].any()  # the image never sees <eoi>
