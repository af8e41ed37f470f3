"""A small byte-level BPE tokenizer for tiny checkpoints, trained offline on the bundled corpus.txt.

Same arguments, same bytes: the `tokenizers` BPE trainer is deterministic and both files are written with sorted keys.
"""
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = Path(__file__).with_name("corpus.txt")


def write_tokenizer(path, vocab_size: int, special_tokens: dict[str, str], chat_template: str, bos: str = "bos",
                    eos: str = "eos", pad: str = "pad", add_bos: bool = True, model_max_length: int = 4096) -> Path:
    """Save tokenizer.json + tokenizer_config.json that transformers.AutoTokenizer loads.

    special_tokens: role -> token string, e.g. {"bos": "<|begin|>", "eos": "<|end|>", "user": "<|User|>"}; each
    becomes one id (the first ids, in this order). bos / eos / pad name roles in it (pad falls back to eos).
    add_bos: plain encode() prepends the bos token (a chat template writes its own). Total vocab <= vocab_size.
    """
    specials = list(special_tokens.values())
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} < 256 byte tokens + {len(specials)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.read_text().split("\n\n"), trainer)
    bos_token, eos_token = special_tokens.get(bos), special_tokens.get(eos)
    if add_bos and bos_token:
        bos_id = tokenizer.token_to_id(bos_token)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)])
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
        "add_bos_token": bool(add_bos and bos_token),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "model_max_length": model_max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
