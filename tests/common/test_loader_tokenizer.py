"""The offline byte-level BPE tokenizer: loads with AutoTokenizer, round-trips text, renders the chat template."""
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from common.loader import write_tokenizer

SPECIAL = {"bos": "<|begin|>", "eos": "<|end|>", "user": "<|User|>", "assistant": "<|Assistant|>"}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}"
            "{% else %}<|Assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|Assistant|>{% endif %}")
VOCAB = 1024


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB, SPECIAL, TEMPLATE)


def test_loads_and_round_trips_text(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) <= VOCAB and max(tok.get_vocab().values()) < VOCAB
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin|>", "<|end|>", "<|end|>")
    for text in ["The weather is nice today.", "  Unseen wörds, ünïcode & digits 12345!\n\ttabs 🙂"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode("the weather", add_special_tokens=False)) < len("the weather")  # merges were learned


def test_special_tokens_are_single_ids(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL.values()]
    assert ids == [0, 1, 2, 3]
    assert tok.encode("".join(SPECIAL.values()), add_special_tokens=False) == ids
    assert tok.decode(tok.encode("<|User|>hi<|Assistant|>yo<|end|>"), skip_special_tokens=True) == "hiyo"


def test_chat_template_renders_and_tokenizes(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time."},
                {"role": "user", "content": "More!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|begin|><|User|>Tell me a story.<|Assistant|>Once upon a time.<|end|><|User|>More!<|Assistant|>"
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(text, add_special_tokens=False)  # one bos, from the template
    assert ids.count(tok.bos_token_id) == 1 and ids[-1] == tok.convert_tokens_to_ids("<|Assistant|>")


def test_writes_are_byte_identical_across_processes(tokenizer_dir, tmp_path):
    code = "import sys; from common.loader import write_tokenizer; write_tokenizer(sys.argv[1], %d, %r, %r)" % (
        VOCAB, SPECIAL, TEMPLATE)
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tokenizer_dir / name).read_bytes()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_rejects_a_vocab_too_small_for_the_bytes(tmp_path):
    with pytest.raises(ValueError, match="256 byte tokens"):
        write_tokenizer(tmp_path, 258, SPECIAL, TEMPLATE)


def test_add_eos_appends_the_eos_token_clip_style(tmp_path):
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path, VOCAB, SPECIAL, "", add_bos=True, add_eos=True))
    ids = tok("a red fox", padding="max_length", max_length=12).input_ids
    n = len(tok.encode("a red fox", add_special_tokens=False))
    assert ids[0] == tok.bos_token_id and ids[n + 1] == tok.eos_token_id  # bos, text, eos, then pad (= eos)
    assert ids[n + 2:] == [tok.pad_token_id] * (10 - n)
    eos_only = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "e", VOCAB, SPECIAL, "", add_bos=False,
                                                             add_eos=True))
    assert eos_only.encode("fox") == eos_only.encode("fox", add_special_tokens=False) + [eos_only.eos_token_id]
