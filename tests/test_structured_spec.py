"""Structured outputs under speculative decoding: every tree node masked by its grammar state.

Oracles: a matcher fed the committed output plus a node's path, then asked for its next-token
mask (the tree walk must give every reachable node that row); plain decoding under the same
grammar (greedy float32: token-identical, with a control that removes the tree masks and must
fail); a two-sample chi-squared test of speculative against plain sampling on a tiny grammar;
`re.fullmatch` and `jsonschema` for outputs sampled under every speculative algorithm, alone and
in batches mixed with free requests.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest
import torch

from spectral import Engine
from spectral.constrained import GrammarBackend, allocate_bitmask
from spectral.speculative.tree import trees_from_parents
from tests.test_spec_tree import chi2_critical
from tests.test_speculative import make_random_head
from tests.test_structured import COLORS, PERSON, REGEXES, SCHEMAS, chat, check


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, 49152, [2])


def test_tree_masks_equal_a_matcher_fed_each_nodes_path(backend, tokenizer):
    """Random trees over likely and unlikely tokens (stop tokens among them): each node the
    grammar accepts along its whole path gets the row of a fresh matcher fed the committed
    output and that path; every other row allows all tokens; the walk leaves the state as it
    was."""
    rng = random.Random(0)
    kind, text = "json_schema", json.dumps(PERSON)
    committed = tokenizer.encode('{"name": "Al', add_special_tokens=False)
    grammar = backend.matcher(kind, text)
    for token in committed:
        assert grammar.accept(token)
    vocab = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize('ice", "age": 41}')]
    vocab += [2, 0, 100, 4000]  # the stop token, <|endoftext|> and two unrelated tokens
    before = allocate_bitmask(1, 49152)
    grammar.fill(before, 0)
    for trial in range(30):
        n = rng.randint(2, 24)
        parents = [rng.randint(0, i) for i in range(n - 1)]
        tokens = [rng.choice(vocab) for _ in range(n - 1)]
        trees = trees_from_parents([committed[-1]], [tokens], [parents], n)
        rows = grammar.tree_bitmask(trees.tokens[0], trees.next_token[0], trees.next_sibling[0])
        for j in range(n):
            path, node = [], j
            while node > 0:
                path.append(tokens[node - 1])
                node = parents[node - 1]
            fresh = backend.matcher(kind, text)
            ok = all(fresh.accept(t) for t in committed + path[::-1])
            expected = allocate_bitmask(1, 49152)
            if ok and not fresh.terminated:
                fresh.fill(expected, 0)
            assert torch.equal(rows[j], expected[0]), (trial, j, path)
        after = allocate_bitmask(1, 49152)
        grammar.fill(after, 0)
        assert torch.equal(after, before)


def test_forced_tokens_spell_the_only_text_the_grammar_allows(backend, tokenizer):
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    grammar = backend.matcher("regex", r"Answer: (yes|no)\.")
    forced = grammar.forced_tokens(encode, 8)
    assert tokenizer.decode(forced) == "Answer: "
    assert grammar.forced_tokens(encode, 1) == forced[:1]
    for token in forced:  # the state did not move: the chain is still accepted
        assert grammar.accept(token)
    assert grammar.forced_tokens(encode, 8) == []  # yes or no: a choice
    assert grammar.accept(encode("yes")[0])
    assert tokenizer.decode(grammar.forced_tokens(encode, 8)) == "."


# ---- engines ---------------------------------------------------------------------------------

GRAMMARS = [
    ("json_schema", json.dumps(PERSON)),
    ("regex", REGEXES[0]),
    ("ebnf", COLORS),
]
# Nested, enumerated and boolean, yet short to sample.
FLAGS = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
    },
    "required": ["ok", "tags"],
    "additionalProperties": False,
}
# An array of bounded integers (a free JSON number may run on for many digits when sampled).
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}
COLORS_REGEX = "(red|green|blue)(, (red|green|blue)){0,2}"  # the language of COLORS
QUESTIONS = [
    "Describe a person as JSON.",
    "Who lives in Oslo?",
    "Give me a phone number.",
    "Name some colors.",
    "Write a record for Ana, 31, from Lima.",
    "What is your favourite color?",
    "Tell me about Bob.",
    "Call me maybe.",
    "A person from Paris, please.",
    "Which colors are in the flag?",
    "Who is the oldest person you know?",
    "Give the number of the office.",
    "Describe your neighbour.",
    "List three colors.",
    "Make up a person.",
    "What number should I dial?",
    "Describe a child as JSON.",
    "Paint the wall.",
    "Introduce yourself as JSON.",
    "Answer with colors only.",
]


def make_engine(model_dir: str, **spec) -> Engine:
    return Engine(
        model_path=model_dir,
        dtype="float32",
        max_total_tokens=16384,
        speculative_fixed_tree=True,
        speculative_max_batch_size=64,
        **spec,
    )


@pytest.fixture(scope="module")
def eagle3_engine(default_model_dir):
    """The shipped head with n-gram trees besides (hybrid): head trees, n-gram trees and the
    grammar's forced chains all verified."""
    engine = make_engine(
        default_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="default",
        speculative_hybrid_ngram=8,
    )
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("kind, text", GRAMMARS)
def test_greedy_speculation_under_a_grammar_equals_plain_decoding(
    eagle3_engine, engine_fp32, tokenizer, kind, text
):
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    params = {"temperature": 0, "max_new_tokens": 24, kind: text}
    rounds_before = eagle3_engine.scheduler.stats.spec_verify_ct
    got = eagle3_engine.generate(input_ids=prompts, sampling_params=params)
    want = engine_fp32.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    stats = eagle3_engine.scheduler.stats
    assert stats.spec_verify_ct > rounds_before and stats.spec_accept_length > 1.2


def test_without_the_tree_masks_the_control_fails(
    eagle3_engine, engine_fp32, tokenizer, monkeypatch
):
    """The test above can tell: with every node's row allowing all tokens, outputs leave their
    grammar (the request fails) or differ from plain decoding."""
    from spectral.constrained import Grammar

    def unmasked(self, tokens, next_token, next_sibling):
        return allocate_bitmask(tokens.shape[0], self.vocab_size)

    monkeypatch.setattr(Grammar, "tree_bitmask", unmasked)
    prompts = [chat(tokenizer, q) for q in QUESTIONS[:8]]
    params = {"temperature": 0, "max_new_tokens": 32, "json_schema": json.dumps(PERSON)}
    want = engine_fp32.generate(input_ids=prompts, sampling_params=params)
    got = eagle3_engine.generate(input_ids=prompts, sampling_params=params)
    reasons = [o["meta_info"]["finish_reason"] for o in got]
    failed = [r["message"] for r in reasons if r["type"] == "abort"]
    # only a request leaving its grammar may fail: any other error (a stand-in whose signature
    # drifted, say) is the control failing to run, not the masks being needed
    assert all("does not continue the request's grammar" in m for m in failed), failed
    assert failed or [o["output_ids"] for o in got] != [o["output_ids"] for o in want]


def test_sampled_speculation_on_a_tiny_grammar_follows_plain_sampling(
    eagle3_engine, engine_fp32, tokenizer
):
    """Chi-squared: the 9 outputs of (a|b|c){2} at temperature 1, sampled with and without
    speculation, come from one distribution."""
    prompt = chat(tokenizer, "Write two letters from a, b and c, like ab or ca.")
    params = {"temperature": 1.0, "max_new_tokens": 8, "regex": "(a|b|c){2}"}
    counts = []
    stats = eagle3_engine.scheduler.stats
    accepted_before = stats.spec_emitted_tokens - stats.spec_verify_ct
    for engine in (eagle3_engine, engine_fp32):
        engine.generate(input_ids=prompt, sampling_params=params)  # the prompt into the cache
        outs = engine.generate(input_ids=[prompt] * 120, sampling_params=params)
        counts.append(Counter(o["text"] for o in outs))
    # drafts were accepted: the verification was exercised
    assert stats.spec_emitted_tokens - stats.spec_verify_ct > accepted_before
    keys = sorted(set(counts[0]) | set(counts[1]))
    assert all(len(k) == 2 and set(k) <= set("abc") for k in keys)
    stat, dof = two_sample_chi2(counts[0], counts[1], keys)
    assert stat < chi2_critical(dof), counts  # p = 0.001


def two_sample_chi2(a: Counter, b: Counter, keys: list[str]) -> tuple[float, int]:
    """Pearson's statistic that two samples of categories come from one distribution, and its
    degrees of freedom."""
    observed = torch.tensor([[a[k] for k in keys], [b[k] for k in keys]], dtype=torch.float64)
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    return float(((observed - expected) ** 2 / expected).sum()), len(keys) - 1


@pytest.mark.parametrize("algorithm", [None, "NGRAM", "EAGLE", "EAGLE3"])
def test_sampled_outputs_match_their_grammars_under_every_algorithm(
    algorithm, default_model_dir, tmp_path, eagle3_engine, engine_fp32, tokenizer
):
    """Temperature 0.8, plainly (None), under NGRAM, EAGLE and EAGLE3 with n-gram trees (the
    head's trees, n-gram trees and grammar drafts): one request alone,
    and eight in a batch (five under grammars, three free): every grammar output parses and
    validates or fully matches, and ends with stop; plainly, a seeded one is the same alone as
    in the batch."""
    shared = {None: engine_fp32, "EAGLE3": eagle3_engine}
    if algorithm in shared:
        engine = shared[algorithm]
    else:
        spec = {"speculative_algorithm": algorithm}
        if algorithm == "EAGLE":  # a random head: drafts mostly wrong, masked all the same
            spec["speculative_draft_model_path"] = make_random_head(
                tmp_path, default_model_dir, "eagle"
            )
        engine = make_engine(default_model_dir, **spec)
    try:
        cases = [
            ("json_schema", json.dumps(SCHEMAS[0])),
            ("regex", REGEXES[0]),
            ("json_schema", json.dumps(FLAGS)),
            ("ebnf", COLORS),
            ("json_schema", json.dumps(SCORES)),
        ]
        prompts, params = [], []
        for i, (kind, text) in enumerate(cases):
            prompts.append(chat(tokenizer, f"Answer number {i}, please."))
            params.append({"temperature": 0.8, "seed": i, "max_new_tokens": 256, kind: text})
            if i < 3:
                prompts.append(chat(tokenizer, f"Tell me a short story number {i}."))
                params.append({"temperature": 0.8, "max_new_tokens": 12})
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        grammar_outs = [o for o, p in zip(outs, params) if len(p) == 4]
        alone = engine.generate(input_ids=prompts[0], sampling_params=params[0])
        cases.append(cases[0])
        grammar_outs.append(alone)
        if algorithm is None:  # (speculative draws depend on the trees, which the batch shapes)
            assert alone["output_ids"] == outs[0]["output_ids"]
        for (kind, text), out in zip(cases, grammar_outs):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            if kind == "ebnf":
                kind, text = "regex", COLORS_REGEX
            check(kind, text, out["text"])
        if algorithm is not None:
            assert engine.scheduler.stats.spec_verify_ct > 0
    finally:
        if algorithm not in shared:
            engine.shutdown()


def test_a_request_joins_once_the_speculative_worker_has_its_grammar_too(
    peaky_model_dir, tmp_path, monkeypatch
):
    """The worker masks draft trees with matchers of its own (in a server, in its own process).
    A request under a grammar waits until the worker has compiled it as well, so that no round
    waits for a compile while the others decode; once it has, the request joins and its tokens
    are plain decoding's under the grammar; nothing leaks."""
    import threading

    from spectral.core.req import Req
    from spectral.sampling_params import SamplingParams
    from tests.conftest import make_scheduler, scheduler_leaks
    from tests.test_speculative import make_spec_scheduler

    regex = "(yes|no), [0-9]{2,4}"
    release = threading.Event()
    held: list[GrammarBackend] = []  # the worker's compiler: its compile of `regex` waits
    compile_now = GrammarBackend._compile

    def held_compile(self, kind, text):
        if self in held and text == regex:
            release.wait(timeout=30)
        return compile_now(self, kind, text)

    monkeypatch.setattr(GrammarBackend, "_compile", held_compile)
    head = make_random_head(tmp_path / "head", peaky_model_dir, "eagle3")
    s = make_spec_scheduler(
        peaky_model_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=head
    )
    held.append(s.worker.grammars.backend.get())

    def reqs():
        free = Req("free", [5, 6, 7], SamplingParams(max_new_tokens=24, temperature=0.0))
        ruled_params = SamplingParams(max_new_tokens=16, temperature=0.0, regex=regex)
        ruled = Req("ruled", [5, 6, 8], ruled_params)
        return free, ruled

    plain = make_scheduler(peaky_model_dir)
    expected = reqs()
    for req in expected:
        plain.add_request(req)
    while plain.has_work:
        plain.step()
    free, ruled = reqs()
    s.add_request(free)
    s.add_request(ruled)
    ours = s.grammars.backend().compile_later("regex", regex)
    steps, deadline = 0, time.monotonic() + 30
    while steps < 8 or (not ours.done() and time.monotonic() < deadline):
        s.step()  # at least 8, on until the scheduler's compile is done (its own thread's pace)
        steps += 1
    assert ours.done() and ours.exception() is None  # the scheduler's compile is done
    assert ruled in s.grammars.compiling and len(free.output_ids) > 0
    assert s.stats.spec_verify_ct > 0  # rounds went on meanwhile
    release.set()
    while s.has_work:
        s.step()
    assert [free.output_ids, ruled.output_ids] == [r.output_ids for r in expected]
    assert s.grammars.take_rejected() == []
    assert scheduler_leaks(s) == []
