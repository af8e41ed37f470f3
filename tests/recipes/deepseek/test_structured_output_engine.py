"""Structured output through LLMEngine on the tiny random DeepSeek-V4 (fp32): every output satisfies its
constraint (JSON schema, JSON object, regex, choice, the DSML tool-call structural tag), greedy and seeded;
the constraint starts right after reasoning_end_token_id; MTP drafts (rejected by the random MTP layer, or right for
a while then wrong) give the tokens of plain decoding under the same grammar; refusals come from make_request."""
import copy
import json
import re

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from common.engine import LLM, SamplingParams, StructuredOutputManager, StructuredOutputsParams
from tiny_deepseek_v4 import write_tiny_checkpoint
from weights_deepseek_v4 import load_model
from mtp_oracle import OracleProposer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "city": {"type": "string", "maxLength": 3}},
          "required": ["name", "age", "ok", "city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {  # byte-level DSML: ~150 tokens
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}]
DSML = re.compile('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n((?:.|\n)*)</｜DSML｜invoke>\n'
                  '</｜DSML｜tool_calls>')
PARAM = re.compile(r'\s*<｜DSML｜parameter name="(\w+)" string="(true|false)">(.*?)</｜DSML｜parameter>\s*')
REGEX = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("so") / "ckpt", seed=3, quantized=False,
                                 num_nextn_predict_layers=1)
    tok = AutoTokenizer.from_pretrained(path)
    model = load_model(path, torch.float32, mtp=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (6, 11)]
    return model, tok, prompts, LLM(model, tok, block_size=16)


def params(so: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 60, "structured_outputs": so, **kw})


def check_schema(text: str):
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "ok", "city"}
    assert isinstance(obj["name"], str) and re.fullmatch("[a-z]{1,4}", obj["name"])
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 3  # json.loads: no raw control character
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 99 and type(obj["ok"]) is bool


def test_json_schema_greedy_and_seeded(setup):
    model, tok, prompts, llm = setup
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    batch = [params(so), params(so, temperature=1.0, seed=7)]
    outs = llm.generate([prompts[0]] * len(batch), batch, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] in model.args.eos_token_ids
        check_schema(out.text)
    assert llm.engine.kv_cache.all_blocks_free()


def test_json_object_regex_choice_and_terminated_grammars_stop(setup):
    model, tok, prompts, llm = setup
    choices = ["yes", "no", "maybe"]
    batch = [params(StructuredOutputsParams(json_object=True), max_tokens=30),
             params(StructuredOutputsParams(regex=REGEX), ignore_eos=True),
             params(StructuredOutputsParams(regex=REGEX), temperature=1.0, seed=3, ignore_eos=True),
             params(StructuredOutputsParams(choice=choices), temperature=1.0, seed=4, ignore_eos=True),
             params(StructuredOutputsParams(regex=REGEX), ignore_eos=True, skip_special_tokens=False)]
    outs = llm.generate([prompts[0]] * len(batch), batch, use_tqdm=False)
    obj, *rest = outs
    assert obj.finish_reason in ("stop", "length")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a random model may wander inside a string: the text still begins an object
        assert obj.text.startswith("{")
    for out in rest:  # ignore_eos: the grammar's end still stops the request, at its EOS
        assert out.finish_reason == "stop" and out.token_ids[-1] in model.args.eos_token_ids
    assert re.fullmatch(REGEX, rest[0].text) and re.fullmatch(REGEX, rest[1].text)
    assert rest[2].text in choices
    assert rest[3].token_ids == rest[0].token_ids and rest[3].text == rest[0].text + tok.eos_token  # EOS kept


def test_dsml_tool_call_structural_tag(setup):
    model, tok, prompts, llm = setup
    tag = xgr.get_model_structural_tag("deepseek_v4", tools=TOOLS, tool_choice="required", reasoning=False,
                                       parallel_tool_calls=False, max_whitespace_cnt=1).model_dump(mode="json")
    out = llm.generate([prompts[1]], params(StructuredOutputsParams(structural_tag=tag), max_tokens=200,
                                            ignore_eos=True, skip_special_tokens=False), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text.endswith(tok.eos_token), out.text
    body = DSML.fullmatch(out.text.removesuffix(tok.eos_token))  # the markup, whether or not its tokens are special
    assert body, out.text
    found = {m.group(1): (m.group(2), m.group(3)) for m in PARAM.finditer(body.group(1))}
    assert "".join(m.group(0) for m in PARAM.finditer(body.group(1))) == body.group(1)
    assert found == {"city": ("true", found["city"][1])} and found["city"][1] in ("Paris", "Rome")


def reasoning_case(tok, llm, prompt):
    """(params, m): a thinking prompt whose unconstrained greedy output first shows token `end` at index m >= 2;
    constrained with reasoning_end_token_id=end, the output is that reasoning, then the regex."""
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    m = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    so = StructuredOutputsParams(regex="[0-9]{4}", reasoning_end_token_id=free.token_ids[m])
    return params(so, skip_special_tokens=False, ignore_eos=True), free.token_ids[: m + 1]


def test_reasoning_end_token_starts_the_constraint(setup):
    model, tok, prompts, llm = setup
    think = tok.convert_tokens_to_ids("<think>")
    prompt = prompts[0] + [think]
    p, reasoning = reasoning_case(tok, llm, prompt)
    out = llm.generate([prompt], p, use_tqdm=False)[0]
    assert out.token_ids[: len(reasoning)] == reasoning  # no mask while reasoning, the end token included
    answer = tok.decode(out.token_ids[len(reasoning):-1])
    assert re.fullmatch("[0-9]{4}", answer) and out.finish_reason == "stop"  # constrained right after it


class Recording(StructuredOutputManager):
    """Counts the verify windows that hold the reasoning boundary, and those with a draft the grammar refuses."""

    def __init__(self, tok, model):
        super().__init__(tok, model.args.vocab_size, model.args.eos_token_ids)
        self.boundaries = self.refused = 0

    def apply(self, logits, rows):
        for state, _, drafts in rows:
            if not state.reasoning_ended and state.reasoning_end_token_id in drafts:
                self.boundaries += 1
            elif state.reasoning_ended and drafts:
                m = state.matcher.fork()
                self.refused += not all(m.accept_token(d) for d in drafts)
        super().apply(logits, rows)


def test_mtp_drafts_under_a_grammar_equal_plain_decoding(setup):
    model, tok, prompts, llm = setup
    think = tok.convert_tokens_to_ids("<think>")
    reasoning_prompt = prompts[0] + [think]
    reasoning_params, _ = reasoning_case(tok, llm, reasoning_prompt)
    inputs = [prompts[1], reasoning_prompt]
    batch = [params(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)), reasoning_params]
    plain = llm.generate(inputs, batch, use_tqdm=False)
    reference = {tuple(ids): out.token_ids for ids, out in zip(inputs, plain)}
    for oracle in (False, True):
        spec = LLM(copy.deepcopy(model), tok, block_size=16, num_speculative_tokens=2)  # an engine per model
        engine = spec.engine
        if oracle:  # drafts right for a while: the reasoning boundary falls inside the draft window
            engine.proposer = OracleProposer(engine.proposer, reference, engine.contract.vocab_size)
            engine.structured_output = Recording(tok, model)
        outs = spec.generate(inputs, batch, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert engine.stats.num_draft_tokens > 0 and engine.kv_cache.all_blocks_free()
        if oracle:
            assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
            assert engine.structured_output.boundaries > 0 and engine.structured_output.refused > 0
            sampled = spec.generate([prompts[1]], params(StructuredOutputsParams(json=SCHEMA,
                                    disable_any_whitespace=True), temperature=1.0, seed=9), use_tqdm=False)[0]
            check_schema(sampled.text)  # the speculative rule sampled from masked rows


def test_seeded_samples_keep_their_own_grammar_state(setup):
    model, tok, prompts, llm = setup
    so = StructuredOutputsParams(regex="[a-z]{2}[0-9]{3}")
    batch = [params(so, temperature=1.0, seed=s) for s in (1, 2)]
    together = llm.generate([prompts[0]] * 2, batch, use_tqdm=False)
    alone = [llm.generate([prompts[0]], p, use_tqdm=False)[0] for p in batch]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(re.fullmatch("[a-z]{2}[0-9]{3}", o.text) for o in together)


def test_refusals_come_before_the_request_is_queued(setup):
    model, tok, prompts, llm = setup
    engine = llm.engine
    for so, message in [(StructuredOutputsParams(json={"type": "string", "format": "regex"}), "string format 'regex'"),
                        (StructuredOutputsParams(regex="a(?<!b)"), "Lookbehind"),
                        (StructuredOutputsParams(regex="a", reasoning_end_token_id=10 ** 6), "is not a token id")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompts[0], params(so))
    assert not engine.has_unfinished()
