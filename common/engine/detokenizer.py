"""Incremental detokenization: the text of a growing output at a cost per update that does not grow with the
output's length (decoding all of it on every token is quadratic), and the stop-string search over its new tail.

Both paths decode a short window of recent ids and hand out what the window's text gained, as vLLM's incremental
detokenizers do. The text ends where the last complete character ends: while the window's text ends in U+FFFD (an
incomplete UTF-8 character) its tokens are held back, until the tokens that complete the character arrive.
- A tokenizer with a `tokenizers` backend (a `tokenizers.Tokenizer`, or a transformers fast tokenizer's
  `backend_tokenizer`) uses `tokenizers.decoders.DecodeStream`, that window in Rust.
- Any other tokenizer with `decode(ids, skip_special_tokens=...)` uses the same scheme here: the window is the
  ids last read (the prefix, for context) plus the new ones; once its text is longer than the prefix's and does
  not end in U+FFFD, the excess is the delta, and the ids just read become the next window. It holds more than
  the ids last read and the new ones only while their text ends inside a character (`window`, for tests).

`text` is `tokenizer.decode(output_ids, skip_special_tokens=...)` less a trailing incomplete character, with one
exception: clean_up_tokenization_spaces (transformers applies it in decode where the flag is set and the model is
not BPE: WordPiece / Unigram encoders, never the project's byte-level BPE tokenizers) edits text across tokens
(" ' s" -> "'s"), which a delta cannot take back, so those tokenizers' text is the decode without cleanup.
With `prompt_token_ids`, the last CONTEXT of them are the first window's prefix, so the text is the output as it
continues the prompt: the same for byte-level BPE; a SentencePiece first token ("▁word") keeps the leading space
that decoding the output alone strips.
"""
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"  # what a decode of an incomplete UTF-8 character ends with
CONTEXT = 5  # prompt tokens of context for the first output tokens (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


class IncrementalDetokenizer:

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_token_ids: list[int] | None = None):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.text = ""  # all output text so far
        backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        self.backend = backend if isinstance(backend, Tokenizer) else None  # its decode never cleans up
        self.decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self.decode_kwargs["clean_up_tokenization_spaces"] = False
        context = list(prompt_token_ids or [])[-CONTEXT:]
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # ends inside a character (or byte-fallback bytes): the output's text would join it
        if self.backend is not None:
            self.stream = DecodeStream(context, skip_special_tokens)
        else:  # the window: ids decoded with the next ones, of which the first `read` made prefix_len characters
            self.window, self.read, self.prefix_len = context, len(context), len(self._decode(context))

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they add ("" while it ends inside a character, or they are skipped)."""
        if not new_token_ids:
            return ""
        delta = self._stream_step(list(new_token_ids)) if self.backend is not None else self._window_step(new_token_ids)
        self.text += delta
        return delta

    def _stream_step(self, ids: list[int]) -> str:
        try:
            return self.stream.step(self.backend, ids) or ""
        except Exception as e:  # a decoder whose text is not prefix-stable (as vLLM: restart, without context)
            if "Invalid prefix" not in str(e):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.backend, ids) or ""

    def _window_step(self, ids: list[int]) -> str:
        self.window += ids
        text = self._decode(self.window)
        if len(text) <= self.prefix_len or text.endswith(REPLACEMENT):
            return ""
        delta = text[self.prefix_len:]
        self.window = self.window[self.read:]  # the ids just read: the next window's prefix
        self.read, self.prefix_len = len(self.window), len(self._decode(self.window))
        return delta

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, **self.decode_kwargs)


def find_stop(text: str, num_new_chars: int, stop: list[str]) -> int | None:
    """Index in text where the earliest stop string begins, searching only the tail that can contain a stop string
    ending in the last num_new_chars characters; None when none.

    Called after every update, no stop string ends before those characters, so this is the result of a search of
    the whole text. Stop strings are non-empty (SamplingParams checks)."""
    old = len(text) - min(num_new_chars, len(text))
    hits = [i for s in stop if (i := text.find(s, max(0, old - len(s) + 1))) >= 0]
    return min(hits, default=None)
