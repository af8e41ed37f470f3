"""The encoder stage's bookkeeping: the encoder cache's references and capacity, placeholder expansion and placement
checks, and block hashes keyed by the content of the images a block holds."""
import pytest
import torch

from common.engine.encoder_cache import EncoderCache, gather_embeddings
from common.engine.multimodal import EncoderInput, MultiModalInput, check_placements, content_hash, \
    expand_placeholders, multimodal_prompt
from common.kv_cache import hash_block, hash_blocks

P = 9  # the placeholder id


def test_encoder_cache_shares_by_identifier_and_frees_with_its_last_holder():
    cache = EncoderCache(capacity=10)
    a, b = MultiModalInput("a", 0, 4), MultiModalInput("b", 5, 6)
    assert cache.hold("r1", a) and not cache.hold("r2", a)  # r2 shares r1's entry: nothing new to encode
    assert cache.num_tokens == 4 and cache.can_reserve(6) and not cache.can_reserve(7)
    with pytest.raises(RuntimeError, match="reserved but not encoded"):
        cache.get("a")
    with pytest.raises(ValueError, match="3 rows for an item of 4"):
        cache.put("a", torch.zeros(3, 2))
    cache.put("a", torch.ones(4, 2))
    assert cache.hold("r1", b) and cache.num_tokens == 10
    with pytest.raises(RuntimeError, match="encoder cache full"):
        cache.hold("r3", MultiModalInput("c", 0, 1))
    cache.release("r1", "a")
    assert "a" in cache and cache.holds("r2", "a") and not cache.holds("r1", "a")
    cache.release_request("r1")  # b's only holder
    assert "b" not in cache and cache.num_tokens == 4
    cache.release_request("r2")
    cache.release_request("unknown")
    assert len(cache) == 0 and cache.num_tokens == 0


def test_gather_takes_each_chunks_slice_of_its_images():
    cache = EncoderCache(100)
    items = [MultiModalInput("a", 2, 4), MultiModalInput("b", 8, 3)]
    for mm in items:
        cache.hold("r", mm)
        cache.put(mm.identifier, torch.arange(mm.length * 2, dtype=torch.float32).view(mm.length, 2) + 100 * mm.offset)
    # the request's chunk covers positions [4, 10) at rows 3.. of the batch: a's last two rows, b's first two
    rows, pieces = gather_embeddings(cache, [([], 0, 3, 0), (items, 4, 10, 3)])
    assert rows == [3, 4, 7, 8]
    assert torch.equal(torch.cat(pieces), torch.tensor([[204., 205.], [206., 207.], [800., 801.], [802., 803.]]))


def test_expand_and_check_placements():
    items = [EncoderInput("x", 3, "h1"), EncoderInput("y", 2, "h2")]
    ids, placed = expand_placeholders([1, P, 2, P], items, P)
    assert ids == [1, P, P, P, 2, P, P]
    assert [(m.identifier, m.offset, m.length, m.data) for m in placed] == [("h1", 1, 3, "x"), ("h2", 5, 2, "y")]
    check_placements(ids, placed, P)
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_placeholders([P, P], items[:1], P)
    check_placements(ids, placed[:1], P)  # a placeholder id without an image: a text token
    with pytest.raises(ValueError, match="overlaps another or lies outside"):
        check_placements(ids, [placed[1], placed[0]], P)
    with pytest.raises(ValueError, match="not all image placeholders"):
        check_placements([1, P, 3], [MultiModalInput("h", 1, 2)], P)
    with pytest.raises(ValueError, match="at least one token"):
        EncoderInput("x", 0, "h")
    assert multimodal_prompt({"prompt": "t", "multi_modal_data": {"image": b"i"}}) == ("t", [b"i"])
    with pytest.raises(ValueError, match="prompt dict"):
        multimodal_prompt({"text": "t"})
    with pytest.raises(ValueError, match='takes "image"'):
        multimodal_prompt({"prompt": "t", "multi_modal_data": {"video": 1}})


def test_content_hash_follows_content_shape_and_dtype():
    x = torch.arange(6, dtype=torch.bfloat16)
    assert content_hash(x, 2, 3) == content_hash(x.clone(), 2, 3)
    assert len({content_hash(x, 2, 3), content_hash(x.view(2, 3), 2, 3), content_hash(x.float(), 2, 3),
                content_hash(x, 3, 2), content_hash(x + 1, 2, 3)}) == 5


def test_block_hashes_key_images_by_content():
    tokens = [1, 2, 3, 4, P, P, P, P, P, P, 5, 6]  # blocks of 4: text | image | image + text
    plain = hash_blocks(tokens, 4)
    a = hash_blocks(tokens, 4, mm_spans=[MultiModalInput("imgA", 4, 6)])
    a2 = hash_blocks(tokens, 4, mm_spans=[MultiModalInput("imgA", 4, 6)])
    b = hash_blocks(tokens, 4, mm_spans=[MultiModalInput("imgB", 4, 6)])
    assert a == a2  # the same image: the same blocks
    assert a[0] == b[0] == plain[0]  # the text before it is shared
    assert a[1] != b[1] and a[2] != b[2]  # the same placeholder ids under another image: other blocks
    assert a[1] != plain[1]
    assert plain[0] == hash_block(0, (1, 2, 3, 4))  # without images, hashes are what they were
    shifted = hash_blocks(tokens, 4, mm_spans=[MultiModalInput("imgA", 5, 5)])
    assert shifted[1] != a[1]  # where the image starts in the block counts
