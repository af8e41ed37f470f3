"""A small byte-level BPE tokenizer for tiny checkpoints, trained offline on the bundled corpus.txt.

Same arguments, same bytes: the `tokenizers` BPE trainer is deterministic and both files are written with sorted keys.
"""
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = Path(__file__).with_name("corpus.txt")


def write_tokenizer(path, vocab_size: int, special_tokens: dict[str, str], chat_template: str, bos: str = "bos",
                    eos: str = "eos", pad: str = "pad", add_bos: bool = True, add_eos: bool = False,
                    model_max_length: int = 4096, extra_corpus: tuple[str, ...] = (),
                    last_special_tokens: tuple[str, ...] = ()) -> Path:
    """Save tokenizer.json + tokenizer_config.json that transformers.AutoTokenizer loads.

    special_tokens: role -> token string, e.g. {"bos": "<|begin|>", "eos": "<|end|>", "user": "<|User|>"}; each
    becomes one id (the first ids, in this order). bos / eos / pad name roles in it (pad falls back to eos).
    add_bos: plain encode() prepends the bos token (a chat template writes its own); add_eos: appends the eos token
    (CLIP-style text encoders pool at it). Total vocab <= vocab_size. extra_corpus: texts trained on besides
    corpus.txt (a chat format's fixed strings, so that its prompts take as few tokens as a real vocabulary's do).
    last_special_tokens: special tokens that take the ids after the trained vocabulary, so that adding one to a
    tokenizer keeps every other id (only the least frequent merges give way): the last ids (vocab_size - len ..
    vocab_size - 1) where the corpus trains that many tokens, else the ids right after those it trains (a model
    vocabulary larger than the corpus fills; ask the saved tokenizer for them).
    """
    specials = list(special_tokens.values())
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} < 256 byte tokens + {len(specials)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(last_special_tokens), min_frequency=2,
                                  special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.read_text().split("\n\n") + list(extra_corpus), trainer)
    if last_special_tokens:  # the ids after the trained vocabulary (the last ones where the corpus fills it)
        tokenizer.add_special_tokens(list(last_special_tokens))
    bos_token, eos_token = special_tokens.get(bos), special_tokens.get(eos)
    add_bos, add_eos = bool(add_bos and bos_token), bool(add_eos and eos_token)
    if add_bos or add_eos:
        head, tail = (f"{bos_token} " if add_bos else ""), (f" {eos_token}" if add_eos else "")
        used = [t for t, on in ((bos_token, add_bos), (eos_token, add_eos)) if on]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}",
            special_tokens=[(t, tokenizer.token_to_id(t)) for t in used])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": special_tokens.get(pad, eos_token),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "model_max_length": model_max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
