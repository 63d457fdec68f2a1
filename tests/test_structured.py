"""Structured outputs (regex, json_schema, ebnf through xgrammar) in plain decoding.

Oracles: transformers' model decoding greedily under xgrammar's own matcher and its own mask
kernel (not spectral's); `re.fullmatch` and `jsonschema` for outputs sampled at temperature
0.8, alone and in batches mixed with free requests; xgrammar's `apply_token_bitmask_inplace`
for spectral's mask. A speculative engine decodes a batch holding a grammar request plainly
(tree masks are not built yet), so its outputs equal plain decoding's.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from spectral.constrained import allocate_bitmask, apply_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
INVENTORY = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "count": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["sku", "count"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "in_stock": {"type": "boolean"},
    },
    "required": ["items", "in_stock"],
}
SCHEMAS = [PERSON, INVENTORY, {"type": "array", "items": {"type": "number"}, "maxItems": 4}]
REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,2}\.",
    r"\d{4}-\d{2}-\d{2}",
]
COLORS = (
    'root ::= color | color ", " color | color ", " color ", " color\n'
    'color ::= "red" | "green" | "blue"'
)


def chat(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def oracle_greedy(hf_model, tokenizer, ids, kind, text, max_new_tokens, stop_ids) -> list[int]:
    """Greedy decoding by transformers under xgrammar's matcher and mask kernel."""
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=hf_model.config.vocab_size, stop_token_ids=stop_ids
    )
    compiler = xgr.GrammarCompiler(info)
    compiled = {
        "regex": compiler.compile_regex,
        "json_schema": lambda t: compiler.compile_json_schema(t, max_whitespace_cnt=16),
        "ebnf": compiler.compile_grammar,
    }[kind](text)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, hf_model.config.vocab_size)
    out: list[int] = []
    past, step = None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = hf_model(step, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1].float()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            token = int(logits.argmax())
            out.append(token)
            step = torch.tensor([[token]])
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
    return out


GREEDY_CASES = [
    ("Describe a person as JSON.", "json_schema", json.dumps(PERSON)),
    ("What is your phone number?", "regex", REGEXES[0]),
    ("Name some colors.", "ebnf", COLORS),
]


@pytest.mark.parametrize("question, kind, text", GREEDY_CASES)
def test_greedy_under_a_grammar_equals_transformers_under_xgrammar(
    engine_fp32, hf_model, tokenizer, question, kind, text
):
    ids = chat(tokenizer, question)
    out = engine_fp32.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 40, kind: text}
    )
    expected = oracle_greedy(
        hf_model, tokenizer, ids, kind, text, 40, list(engine_fp32.scheduler.eos_token_ids)
    )
    assert out["output_ids"] == expected
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def check(kind: str, text: str, output: str) -> None:
    if kind == "regex":
        assert re.fullmatch(text, output), (text, output)
    else:
        jsonschema.validate(json.loads(output), json.loads(text))


def test_sampled_outputs_match_their_grammars_alone_and_mixed_with_free_requests(
    engine_fp32, tokenizer
):
    cases = [("json_schema", json.dumps(s)) for s in SCHEMAS] + [("regex", r) for r in REGEXES]
    prompts, params = [], []
    for i, (kind, text) in enumerate(cases):
        prompts.append(chat(tokenizer, f"Answer number {i}, please."))
        params.append({"temperature": 0.8, "seed": i, "max_new_tokens": 160, kind: text})
        prompts.append(chat(tokenizer, f"Tell me a short story number {i}."))
        params.append({"temperature": 0.8, "seed": i, "max_new_tokens": 12})
    outs = engine_fp32.generate(input_ids=prompts, sampling_params=params)
    for (kind, text), out in zip(cases, outs[::2]):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        check(kind, text, out["text"])
    alone = engine_fp32.generate(input_ids=prompts[0], sampling_params=params[0])
    assert alone["output_ids"] == outs[0]["output_ids"]  # seeded: the same alone as in a batch


def test_the_grammar_ends_the_request_even_with_ignore_eos(engine_fp32, tokenizer):
    out = engine_fp32.generate(
        input_ids=chat(tokenizer, "Yes or no?"),
        sampling_params={
            "temperature": 0,
            "max_new_tokens": 30,
            "regex": "(yes|no)",
            "ignore_eos": True,
        },
    )
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_max_new_tokens_before_the_grammar_ends_gives_length(engine_fp32, tokenizer):
    out = engine_fp32.generate(
        input_ids=chat(tokenizer, "Describe a person as JSON."),
        sampling_params={"temperature": 0, "max_new_tokens": 5, "json_schema": json.dumps(PERSON)},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_the_mask_equals_xgrammars_kernel():
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn((5, vocab), generator=gen)
    mask = allocate_bitmask(5, vocab)
    mask[:] = torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=gen, dtype=torch.int32)
    mask[4] = -1  # a row without a grammar
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask, vocab_size=vocab)
    assert torch.equal(apply_bitmask(logits, mask), expected)


def test_a_speculative_engine_decodes_grammar_batches_as_plain_decoding(
    default_model_dir, engine_fp32, tokenizer
):
    from spectral import Engine

    spec = Engine(
        model_path=default_model_dir,
        dtype="float32",
        max_total_tokens=8192,
        speculative_algorithm="NGRAM",
    )
    try:
        prompts = [chat(tokenizer, "Describe a person as JSON."), chat(tokenizer, "Count to 20.")]
        params = [
            {"temperature": 0, "max_new_tokens": 32, "json_schema": json.dumps(PERSON)},
            {"temperature": 0, "max_new_tokens": 24},
        ]
        got = spec.generate(input_ids=prompts, sampling_params=params)
        want = engine_fp32.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        check("json_schema", json.dumps(PERSON), got[0]["text"])
    finally:
        spec.shutdown()


# ---- over HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(fp32_server):
    import openai

    from tests.conftest import SERVER_API_KEY

    return openai.OpenAI(base_url=fp32_server + "/v1", api_key=SERVER_API_KEY)


def test_openai_response_format_json_schema_and_json_object(client):
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    res = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=120,
        temperature=0.8,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    jsonschema.validate(json.loads(res.choices[0].message.content), PERSON)
    assert res.choices[0].finish_reason == "stop"
    res = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": 'What is 2+2? Answer as {"answer": ...}.'}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert res.choices[0].finish_reason == "stop", res.choices[0].message.content
    assert isinstance(json.loads(res.choices[0].message.content), dict)


def test_native_generate_and_openai_completions_take_sglangs_grammar_fields(fp32_server, client):
    import httpx

    from tests.conftest import SERVER_API_KEY

    body = {
        "text": "The date today is ",
        "sampling_params": {"temperature": 0.8, "max_new_tokens": 16, "regex": REGEXES[3]},
    }
    res = httpx.post(
        fp32_server + "/generate",
        json=body,
        headers={"Authorization": f"Bearer {SERVER_API_KEY}"},
        timeout=60,
    )
    assert re.fullmatch(REGEXES[3], res.json()["text"]), res.text
    res = client.completions.create(
        model="smollm2",
        prompt="Colors I like: ",
        max_tokens=16,
        temperature=0.8,
        extra_body={"ebnf": COLORS},
    )
    assert re.fullmatch(r"(red|green|blue)(, (red|green|blue)){0,2}", res.choices[0].text)
