"""Structured output on a tiny byte-level BPE tokenizer: the params' checks and round trip, the refusals, and the
masks StructuredOutputManager puts on a step's rows (drafts, a rejected draft, the reasoning boundary)."""
import dataclasses
import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from common.engine import SamplingParams, StructuredOutputManager, StructuredOutputsParams
from common.engine.structured_output import json_string_bounds_fixed
from common.engine.utf8_masks import COMPLETE, Utf8State, advance
from common.loader import write_tokenizer

EOS, END_THINK = 1, 2
V = 300  # lm-head rows: more than the tokenizer's ids (padding rows are never allowed)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = write_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=290,
                           special_tokens={"bos": "<s>", "eos": "</s>", "end_think": "</think>"}, chat_template="")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def manager(tok):
    return StructuredOutputManager(tok, V, [EOS], max_threads=1)


def allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits_row > float("-inf")).flatten().tolist())


def masks(manager, state, drafts, rows=None):
    logits = torch.zeros(rows or len(drafts) + 1, V)
    manager.apply(logits, [(state, 0, drafts)])
    return [allowed(r) for r in logits]


def encode(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_params_round_trip_through_json():
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                 reasoning_end_token_id=END_THINK)
    params = SamplingParams(temperature=0.5, seed=3, skip_special_tokens=False, structured_outputs=so)
    rebuilt = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(params))))
    assert rebuilt == params and isinstance(rebuilt.structured_outputs, StructuredOutputsParams)
    assert SamplingParams(**dataclasses.asdict(SamplingParams())).structured_outputs is None


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of .* got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": {"type": "object"}, "json_object": True}, "got json, json_object"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": 3}, "structured_outputs.json must be a dict or a JSON string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list of non-empty strings"),
    ({"regex": 5}, "regex must be a string"),
    ({"json_object": "yes"}, "json_object must be a bool"),
    ({"regex": "a", "reasoning_end_token_id": -1}, "reasoning_end_token_id must be None or an int >= 0"),
])
def test_params_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refuse_unknown_structured_fields():
    with pytest.raises(ValueError, match="unknown fields \\['guided_json'\\]"):
        SamplingParams(structured_outputs={"guided_json": {}})


@pytest.mark.parametrize("kwargs, message", [
    ({"json": {"type": "foo"}}, r'structured_outputs.json: Unsupported type "foo"'),
    ({"json": '{"$ref": "#/$defs/missing"}'}, "structured_outputs.json: .*missing"),
    ({"json": {"type": "array", "uniqueItems": True}}, "unsupported JSON schema feature.*'uniqueItems' at #"),
    ({"json": {"type": "object", "properties": {"not": {"type": "object", "properties": {"x": {"not": {}}}}}}},
     r"'not' at #/properties/not/properties/x$"),  # a property named "not" is no keyword
    ({"json": {"type": "number", "multipleOf": 0.5}}, "'multipleOf' on a non-integer"),
    ({"json": {"type": "string", "format": "iri"}}, "string format 'iri'"),
    ({"json": {"type": "string", "pattern": "^a+$", "maxLength": 3}}, "'maxLength' with 'pattern' at #$"),
    ({"json": {"items": {"type": "string", "format": "email", "minLength": 5}}},
     "'minLength' with 'format' at #/items$"),
    ({"regex": "(?<=a)b"}, "structured_outputs.regex: .*Lookbehind is not supported"),
    ({"regex": "[a"}, "structured_outputs.regex: .*Unclosed"),
    ({"grammar": 'start ::= "a"'}, 'structured_outputs.grammar: .*root rule with name "root" is not found'),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
     "structured_outputs.structural_tag: .*Format type not recognized: nope"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"not": {}}}}},
     "structured_outputs.structural_tag: unsupported JSON schema feature.*'not'"),
    ({"regex": "a", "reasoning_end_token_id": V}, f"reasoning_end_token_id {V} is not a token id"),
])
def test_compile_refusals_name_the_problem(manager, kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        manager.compile(StructuredOutputsParams(**kwargs))
    assert "/project/cpp" not in str(e.value)  # xgrammar's source location is left out


def test_first_mask_is_the_grammar_and_padding_rows_are_excluded(manager, tok):
    state = manager.start(StructuredOutputsParams(regex="[0-9]+"), [5])
    digits = {t for t in range(len(tok)) if re.fullmatch("[0-9]+", tok.decode([t]))}
    assert digits and masks(manager, state, [])[0] == digits  # no EOS before a digit; no id >= len(tok)
    manager.accept(state, min(digits))
    assert masks(manager, state, [])[0] == digits | {EOS}


def test_choice_and_termination(manager, tok):
    state = manager.start(StructuredOutputsParams(choice=['say "hi"', "a\\b"]), [5])
    for t in encode(tok, "a\\b"):
        assert manager.accept(state, t)
    assert masks(manager, state, [])[0] == {EOS}  # complete: only the stop token
    assert not manager.is_terminated(state)
    assert manager.accept(state, EOS) and manager.is_terminated(state)
    assert masks(manager, state, [])[0] == set(range(V))  # a terminated grammar masks nothing more
    assert not manager.accept(state, EOS)


def test_draft_masks_are_the_masks_along_the_drafts_and_the_matcher_rolls_back(manager, tok):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"ab": {"type": "integer"}},
                                           "required": ["ab"]}, disable_any_whitespace=True)
    drafts = encode(tok, '{"ab": 1')
    state = manager.start(params, [5])
    got = masks(manager, state, drafts)
    step = manager.start(params, [5])  # the same grammar, one token at a time
    for i, d in enumerate(drafts):
        assert got[i] == masks(manager, step, [])[0] and d in got[i]
        assert manager.accept(step, d)
    assert got[-1] == masks(manager, step, [])[0]
    assert masks(manager, state, []) == got[:1]  # apply left the request's matcher where it was


def test_a_draft_the_grammar_refuses_is_masked_on_its_row_and_later_rows_are_free(manager, tok):
    state = manager.start(StructuredOutputsParams(regex="[0-9]{4}"), [5])
    digit, letter = encode(tok, "7")[0], encode(tok, "x")[0]
    got = masks(manager, state, [digit, letter, digit])
    assert letter not in got[1]  # the refused draft's row forbids it: verification rejects it
    assert got[2] == got[3] == set(range(V))
    assert masks(manager, state, [])[0] == got[0]


def test_reasoning_boundary_inside_the_draft_window(manager, tok):
    params = StructuredOutputsParams(regex="[0-9]{2}", reasoning_end_token_id=END_THINK)
    word, digit = encode(tok, "x")[0], encode(tok, "7")[0]
    state = manager.start(params, [5, 6])
    got = masks(manager, state, [word, END_THINK, digit, digit])
    digits = got[2]
    assert got[0] == got[1] == set(range(V))  # still reasoning: rows up to the one that samples </think>
    assert digit in digits and word not in digits and EOS not in digits  # the row right after it: constrained
    assert digit in got[3] and EOS not in got[3] and got[4] == {EOS}
    assert not state.reasoning_ended
    for t in (word, END_THINK):
        assert manager.accept(state, t)
    assert state.reasoning_ended and masks(manager, state, [])[0] == digits
    assert manager.start(params, [5, END_THINK]).reasoning_ended  # a prompt that closes the reasoning


def test_one_bitmask_for_several_requests_rows(manager, tok):
    a = manager.start(StructuredOutputsParams(regex="[0-9]+"), [5])
    b = manager.start(StructuredOutputsParams(choice=["x"]), [5])
    logits = torch.zeros(5, V)
    digit = encode(tok, "7")[0]
    manager.apply(logits, [(a, 0, [digit]), (b, 3, [])])  # row 2: an unconstrained request
    rows = [allowed(r) for r in logits]
    assert EOS not in rows[0] and EOS in rows[1] and rows[2] == set(range(V)) and rows[3] == set(encode(tok, "x"))
    assert rows[4] == set(range(V))


def test_utf8_advance_accepts_exactly_the_prefixes_of_well_formed_utf8():
    def well_formed_prefix(pair: bytes) -> bool:  # after the byte after a lead, any of 80..BF may follow
        return _decodes(pair) or any(_decodes(pair + bytes([c]) + b"\x80" * n) for c in (0x80, 0x90, 0xA0)
                                     for n in range(3))

    pairs = [bytes([a, b]) for a in range(256) for b in range(256)]
    got = {pair: advance(COMPLETE, pair) is not None for pair in pairs}
    assert got == {pair: well_formed_prefix(pair) for pair in got}
    assert advance(COMPLETE, "trueabሙ".encode()) == COMPLETE and advance(COMPLETE, b"\xed\xa0\x80") is None
    assert advance(COMPLETE, b"\xf0\x9f") == Utf8State(2, 0x80, 0xBF) and advance(COMPLETE, b"\xed").hi == 0x9F


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")  # strict: refuses surrogates, overlong forms and code points past U+10FFFF
        return True
    except UnicodeDecodeError:
        return False


def test_a_surrogate_the_grammar_would_take_is_masked_and_refused(manager, tok):
    byte = {bytes(b): t for t, b in enumerate(manager.tokenizer_info.decoded_vocab) if len(b) == 1}
    state = manager.start(StructuredOutputsParams(json={"type": "string", "maxLength": 8}), [5])
    for t in encode(tok, '"trueab') + [byte[b"\xed"]]:
        assert manager.accept(state, t)
    got = masks(manager, state, [])[0]
    assert byte[b"\x80"] in got and byte[b"\x9f"] in got  # U+D000..D7FF
    assert not {byte[bytes([b])] for b in range(0xA0, 0xC0)} & got  # ED A0..BF: a surrogate
    assert not manager.accept(state, byte[b"\xa0"])  # xgrammar's matcher alone takes it


def test_sampled_constrained_strings_are_well_formed_and_within_max_length(manager, tok):
    """Random logits favouring the byte tokens of multi-byte characters (2,000 sampled characters; without the
    UTF-8 masks about one in 250 is an encoded surrogate, which decodes to three U+FFFD)."""
    schema = {"type": "string", "maxLength": 8}
    high = torch.tensor([len(b) == 1 and b[0] >= 0x80 for b in manager.tokenizer_info.decoded_vocab])
    gen = torch.Generator().manual_seed(0)
    for _ in range(250):
        state, out = manager.start(StructuredOutputsParams(json=schema), [5]), []
        while not manager.is_terminated(state):
            logits = torch.rand(1, V, generator=gen) * 4 + high * 3
            manager.apply(logits, [(state, 0, [])])
            out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
            assert manager.accept(state, out[-1])
        data = b"".join(manager.tokenizer_info.decoded_vocab[t] for t in out[:-1])
        assert _decodes(data) and tok.decode(out[:-1]) == data.decode()
        jsonschema.validate(json.loads(data), schema)


BOUNDED = {"type": "object", "properties": {"maxLength": {"type": "string", "minLength": 1, "maxLength": 2},
                                            "e": {"enum": [{"maxLength": 3}]}}, "required": ["maxLength"]}


@pytest.mark.parametrize("params, prefix", [
    (StructuredOutputsParams(json=BOUNDED, disable_any_whitespace=True), '{"maxLength": "'),
    (StructuredOutputsParams(json=json.dumps(BOUNDED)), '{ "maxLength": "'),
    (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": BOUNDED}, "end": "</f>"}}),
     '<f>{"maxLength": "'),
])
def test_bounded_json_strings_take_no_raw_control_character(manager, tok, params, prefix):
    controls = {t for t, b in enumerate(manager.tokenizer_info.decoded_vocab) if b and min(b) < 0x20}
    state = manager.start(params, [5])
    for t in encode(tok, prefix):
        assert manager.accept(state, t)
    got = masks(manager, state, [])[0]
    assert controls and not controls & got and encode(tok, "a")[0] in got and encode(tok, '"')[0] not in got
    for t in encode(tok, 'ab'):
        assert manager.accept(state, t)
    assert masks(manager, state, [])[0] == set(encode(tok, '"'))  # the bound holds


def test_only_the_bounded_json_string_rule_is_rewritten():
    xml_string = r"b_characters ::= (([\0-\U0010ffff]))"  # deepseek_xml's raw strings may hold controls
    assert json_string_bounds_fixed(r'a_characters ::= (([^\"\\\r\n]))' + "\n" + xml_string) == \
        r'a_characters ::= (([^\0-\x1f\"\\]))' + "\n" + xml_string
