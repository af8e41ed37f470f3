"""IncrementalDetokenizer and find_stop on real tokenizers, against decoding the whole output and searching the whole
text: the tiny DeepSeek-V4 tokenizer (byte-level BPE trained on English: CJK and emoji are one byte a token), a
byte-level BPE trained here on multilingual text (tokens end inside characters), both on the DecodeStream path,
and two tokenizers without a `tokenizers` backend on the window path: CLVP's Python byte-level BPE over the same
vocab and merges, and ByT5 (a token a byte). Every random draw is seeded."""
import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from common.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, find_stop
from tiny_deepseek_v4 import write_tiny_checkpoint

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "日本語のテキストと中文文本が混在しています。",
             "Emoji: 😀🎉👍🏽 and flags 🇯🇵🇨🇳!", "Café, naïve, façade — “quoted” text…", "数学: ∑ x² ≤ ∞, π ≈ 3.14159.",
             "Привет, мир! Ελληνικά κείμενα.", "한국어 문장도 있습니다.", "print('hello, world')\n\tindent"]
LONG_TEXT = " ".join(random.Random(0).choice(SENTENCES) for _ in range(300))
STREAM, WINDOW = ["deepseek", "bpe", "bpe_fast"], ["clvp", "byt5"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (tokenizer, encode(text) -> ids, vocabulary size for random ids)."""
    deepseek = transformers.AutoTokenizer.from_pretrained(
        write_tiny_checkpoint(tmp_path_factory.mktemp("deepseek"), quantized=False))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("bpe")
    bpe.model.save(str(folder))  # vocab.json + merges.txt, for the Python tokenizer over the same ids
    clvp = transformers.ClvpTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    byt5 = transformers.ByT5Tokenizer()

    def encode(t):
        return lambda text: t.encode(text, add_special_tokens=False)

    bpe_encode = lambda text: bpe.encode(text, add_special_tokens=False).ids  # noqa: E731
    return {"deepseek": (deepseek, encode(deepseek), len(deepseek)),
            "bpe": (bpe, bpe_encode, bpe.get_vocab_size()),
            "bpe_fast": (transformers.PreTrainedTokenizerFast(tokenizer_object=bpe), bpe_encode, bpe.get_vocab_size()),
            "clvp": (clvp, bpe_encode, len(clvp)),  # ids past the BPE's: CLVP's own special tokens
            "byt5": (byt5, encode(byt5), len(byt5))}


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip)


def chunks(ids, rng, most):
    i = 0
    while i < len(ids):
        n = rng.randint(1, most)
        yield ids[i: i + n]
        i += n


@pytest.mark.parametrize("name", STREAM + WINDOW)
def test_streamed_text_equals_decode(tokenizers, name):
    tok, encode, vocab = tokenizers[name]
    rng = random.Random(1)
    text_ids = encode(LONG_TEXT)
    random_ids = [rng.randrange(vocab) for _ in range(3000)] + encode(".")  # "." ends any incomplete character
    assert len(text_ids) >= 2000 and decode(tok, text_ids) == LONG_TEXT
    for ids in (text_ids, random_ids):
        final = decode(tok, ids)
        assert not final.endswith(REPLACEMENT)
        for most in (1, 16):
            det, sent, n = IncrementalDetokenizer(tok), "", 0
            assert (det.backend is not None) == (name in STREAM)
            for k, new in enumerate(chunks(ids, rng, most)):
                sent += det.update(new)
                n += len(new)
                assert sent == det.text and final.startswith(det.text)  # nothing to take back
                if k % 97 == 0:  # the text so far: the decode so far, less an incomplete character
                    so_far = decode(tok, ids[:n])
                    assert det.text == so_far or (so_far.endswith(REPLACEMENT) and so_far.startswith(det.text))
            assert det.text == final


def test_special_tokens_skipped(tokenizers):
    tok, encode, _ = tokenizers["deepseek"]
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    emoji = encode("😀")
    assert len(emoji) == 4  # a byte a token: put special tokens inside the character
    ids = ([tok.bos_token_id, think] + encode("Hello 世界") + [end_think] + emoji[:2] + [tok.eos_token_id]
           + emoji[2:] + encode(" done.") + [tok.eos_token_id])
    for skip in (True, False):
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        for i in ids:
            det.update([i])
        assert det.text == decode(tok, ids, skip)
    assert det.text.count("<think>") == 1 and decode(tok, ids) == "Hello 世界😀 done."


def test_prompt_context(tokenizers):
    tok, encode, _ = tokenizers["deepseek"]
    prompt, out = encode("User: 你好, tell me"), encode(" a story 🐉 with 中文.")
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(det.update([i]) for i in out) == det.text == decode(tok, out)  # byte-level: same as without
    split = encode("你")  # the prompt ends inside a character: no context, the output decodes alone
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt + split[:1])
    assert det.update(split[1:] + out) == decode(tok, split[1:] + out)
    # byte fallback (Llama-style <0xNN> tokens) decodes a run of byte tokens together, all U+FFFD if it starts
    # inside a character: the prompt's last 5 tokens do, so they are no context (the output's bytes would join them)
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"a": 256}
    fallback = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    fallback.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    zhong = list("中".encode())
    det = IncrementalDetokenizer(fallback, prompt_token_ids=zhong * 2)
    assert decode(fallback, zhong[1:] + zhong) == REPLACEMENT * 5
    assert det.update(zhong + [256]) == "中a" == decode(fallback, zhong + [256])
    # SentencePiece-style: decoding the output alone strips its first token's "▁"; after the prompt it is a space
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp.train_from_iterator(["hello world, this is a test"] * 3, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>"], show_progress=False))
    prompt, out = sp.encode("hello world,").ids, sp.encode("this is").ids
    with_context, alone = IncrementalDetokenizer(sp, prompt_token_ids=prompt), IncrementalDetokenizer(sp)
    for i in out:
        with_context.update([i])
        alone.update([i])
    assert with_context.text == " this is" == decode(sp, prompt + out)[len(decode(sp, prompt)):]
    assert alone.text == "this is" == decode(sp, out)


def naive_stop(text, stop):
    hits = [text.find(s) for s in stop if s in text]
    return min(hits) if hits else None


STOP_CASES = [  # (text, stop strings); a stop string is found as soon as it is complete, cut where it begins
    ("The cat sat on the mat. 世界和平 😀🎉 done.", ["世界"]),  # a character split across tokens
    ("The cat sat on the mat. 世界和平 😀🎉 done.", ["mat. 世"]),
    ("The cat sat on the mat. 世界和平 😀🎉 done.", ["🎉 do", "nope"]),
    ("The cat sat on the mat. 世界和平 😀🎉 done.", ["cat sat on", "sat"]),  # "sat" completes first
    ("so ababab abc then", ["abc"]),  # overlapping prefixes: "ab" "ab" before "abc"
    ("xaaab and more", ["aab", "aaab"]),
    ("no stop string here 😀", ["😀!", "zz"]),
]


@pytest.mark.parametrize("name", ["deepseek", "bpe", "clvp"])
@pytest.mark.parametrize("text, stop", STOP_CASES)
def test_stop_strings_across_tokens_and_updates(tokenizers, name, text, stop):
    tok, encode, _ = tokenizers[name]
    ids = encode(text)
    for most in (1, 3, len(ids)):
        rng = random.Random(most)
        pieces = list(chunks(ids, rng, most))
        expected, n = None, 0  # as when the engine decoded everything on every update
        for new in pieces:
            n += len(new)
            full = decode(tok, ids[:n])
            if (cut := naive_stop(full, stop)) is not None:
                expected = full[:cut]
                break
        det, got = IncrementalDetokenizer(tok), None
        for new in pieces:
            delta = det.update(new)
            cut = find_stop(det.text, len(delta), stop)
            assert cut == naive_stop(det.text, stop)
            if cut is not None:
                got = det.text[:cut]
                break
        assert got == expected
        assert (got is None) == (stop[0] == "😀!")


def test_find_stop_matches_a_full_search():
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 30)))
        stop = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        new = rng.randint(0, len(text) + 2)  # more than the text: all of it is new
        if naive_stop(text[: max(0, len(text) - new)], stop) is None:  # as after every update: none ended before
            assert find_stop(text, new, stop) == naive_stop(text, stop)
    text = "a stop string, then " + "x" * 100
    assert find_stop(text, 3, ["stop"]) is None and find_stop(text, len(text), ["stop", "x"]) == 2
    assert find_stop(text + "sto", 3, ["stop", "stops"]) is None and find_stop(text + "stop", 1, ["stop"]) == len(text)


@pytest.mark.parametrize("name", WINDOW)
def test_window_stays_bounded(tokenizers, name):
    """Per-token work does not grow with the output: every decode is of the window plus the new ids, the window
    being the ids read last (context) and those not yet text. It grows only while each token's text ends inside a
    character (or, for ByT5, which drops invalid bytes, adds none): a few tokens in a row in the CJK sentence, whose
    BPE tokens straddle characters, or in random bytes; never with the length of the output."""
    tok, encode, vocab = tokenizers[name]
    rng = random.Random(2)
    for ids, bound in ((encode(LONG_TEXT), 8), ([rng.randrange(vocab) for _ in range(5000)], 32)):
        det, sizes = IncrementalDetokenizer(tok), []
        for i in ids:
            det.update([i])
            sizes.append(len(det.window))
        assert max(sizes) <= bound and sum(sizes) / len(sizes) < 5


def test_cleanup_spaces_is_not_applied():
    """The documented exception: where transformers' decode cleans up tokenization spaces (a WordPiece model with
    clean_up_tokenization_spaces, or ByT5 with it set), the text is the decode without cleanup, on both paths."""
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer, wp.pre_tokenizer, wp.decoder = (normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer(),
                                                   decoders.WordPiece())
    wp.train_from_iterator(["it's fine, isn't it? yes!"] * 3, trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[UNK]"], show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=wp, clean_up_tokenization_spaces=True)
    byt5 = transformers.ByT5Tokenizer(clean_up_tokenization_spaces=True)
    for tok, text in ((fast, "it's fine, isn't it? yes!"), (byt5, "it ' s fine , isn ' t it ?")):
        ids = tok.encode(text, add_special_tokens=False)
        det = IncrementalDetokenizer(tok)
        for i in ids:
            det.update([i])
        assert det.text == tok.decode(ids, clean_up_tokenization_spaces=False) != tok.decode(ids)
        assert tok.decode(ids) in ("it's fine, isn't it? yes!", "it's fine, isn't it?")


def test_a_decoder_that_rewrites_text_restarts_the_stream():
    """DecodeStream raises when a decoder changes text it already handed out (here: replace "ab" in the fused
    text); the detokenizer restarts the stream, as vLLM does, and carries on."""
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    det = IncrementalDetokenizer(tok)
    assert [det.update([i]) for i in (0, 1, 2, 0)] == ["a", "", "c", "a"] and decode(tok, [0, 1, 2, 0]) == "Xca"
