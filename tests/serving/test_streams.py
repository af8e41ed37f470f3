"""TextStream: deltas that concatenate to the engine's text, hold-backs; the template format's reasoning split at
`</think>` however the text is cut."""
from hypothesis import given, settings, strategies as st

from common.engine import RequestOutput
from common.engine.detokenizer import IncrementalDetokenizer
from common.serving.chat_format import ParsedMessage, ThinkParser
from common.serving.streams import TextStream


def output(ids, tokenizer, finished=False, text=None):
    """What the engine hands out after ids: its incremental text (complete characters), or the final text."""
    if text is None:
        detokenizer = IncrementalDetokenizer(tokenizer)
        detokenizer.update(ids)
        text = detokenizer.text
    return RequestOutput("r", None, [1], text, ids, finished, "stop" if finished else None)


def test_reasoning_then_content_split_at_the_end_think_token(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    end = tokenizer.convert_tokens_to_ids("</think>")
    thought, answer = tokenizer("let me see", add_special_tokens=False).input_ids, \
        tokenizer(" it is 4", add_special_tokens=False).input_ids
    ids = thought + [end] + answer + [tokenizer.eos_token_id]
    stream, parser, deltas = TextStream(tokenizer, []), ThinkParser(True, "</think>", tokenizer.eos_token), []
    for k in range(1, len(ids) + 1):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)  # as chat requests decode
        detokenizer.update(ids[:k])
        deltas += parser.feed(stream.update(RequestOutput("r", None, [1], detokenizer.text, ids[:k], k == len(ids),
                                                          "stop" if k == len(ids) else None)))
    message = ParsedMessage.from_deltas(deltas + parser.finish(), thinking=True)
    assert message.reasoning_content == "let me see" and message.content == " it is 4"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=6))
def test_think_parser_gives_the_same_split_however_the_text_is_cut(cuts):
    text = "a < b </thi and </think> so <b> it is </think> 4<｜end▁of▁sentence｜>"
    parser, deltas, at = ThinkParser(True, "</think>", "<｜end▁of▁sentence｜>"), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        deltas += parser.feed(text[at:max(at, cut)])
        at = max(at, cut)
    message = ParsedMessage.from_deltas(deltas + parser.finish(), thinking=True)
    assert message.reasoning_content == "a < b </thi and " and message.content == " so <b> it is </think> 4"
    chat = ParsedMessage.from_deltas(ThinkParser(False, "</think>", None).feed(text[:20]), thinking=False)
    assert chat.reasoning_content is None and chat.content == text[:20]


def test_stop_hold_back_and_incomplete_characters(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    ids = tokenizer("héllo wörld", add_special_tokens=False).input_ids
    stream = TextStream(tokenizer, ["wörld"])
    sent = ""
    for k in range(1, len(ids)):
        delta = stream.update(output(ids[:k], tokenizer))
        sent += delta
        assert "\ufffd" not in sent and "wörld" not in sent
    sent += stream.update(output(ids, tokenizer, finished=True, text="héllo "))
    assert sent == "héllo "


def stream_text(engine, prompt, params, stop=()):
    """Run one request through the engine as the server does: (concatenated deltas, final output)."""
    engine.add_request(prompt, params, "long")
    stream, sent, final = TextStream(engine.tokenizer, list(stop)), "", None
    while engine.has_unfinished():
        for out in engine.step():
            sent += stream.update(out)
            final = out
    return sent, final


def test_a_long_streamed_output_equals_the_decode_of_all_its_tokens(model_and_tokenizer):
    from common.engine import EngineConfig, LLMEngine, SamplingParams
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, EngineConfig(max_model_len=1024))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=400, ignore_eos=True)  # random ids: split UTF-8
    sent, final = stream_text(engine, [5, 6, 7], params)
    full = tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert len(final.token_ids) == 400 and sent == final.text == full.removesuffix("\ufffd")
    assert any("\ufffd" in tokenizer.decode([t]) for t in final.token_ids)  # some tokens are parts of a character
    # a stop string from the middle, split across tokens: the text ends right before it, streamed or not
    start = len(full) // 2
    stop = full[start: start + 4]
    sent, final = stream_text(engine, [5, 6, 7], SamplingParams(temperature=1.0, seed=3, max_tokens=400,
                                                                ignore_eos=True, stop=[stop]), [stop])
    assert final.finish_reason == "stop" and sent == final.text == full[: full.index(stop)]
    assert engine.kv_cache.all_blocks_free()
