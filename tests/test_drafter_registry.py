"""A drafter is one module and one registry entry: a toy drafter defined here alone (it drafts
its request's last token repeated) serves through the registry with no edit to spectral/, and
gives plain decoding's greedy tokens; and no algorithm name is compared outside the registry
and the settings parser."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from spectral.speculative import registry
from spectral.speculative.drafters.expansion import TreeExpansion
from tests.conftest import scheduler_leaks

SPECTRAL = Path(__file__).resolve().parent.parent / "spectral"


class RepeatDrafter:
    """Proposes the root token again at every level: one chain a request."""

    capture_layers: tuple[int, ...] = ()
    needs_features = False
    cost_key = "repeat-the-last-token"

    def __init__(self, num_steps: int) -> None:
        self.num_steps = num_steps
        self.drafts = 0

    def observe_step(self, batch, next_ids, features) -> None:
        pass

    def observe_round(self, batch, prefix_lens, accepted, emitted, slots, features, drafted=True):
        pass

    def use_graphs(self, batch_sizes: list[int]) -> dict | None:
        return None

    def flush(self) -> None:
        pass

    def top1(self, rows: list[int]) -> list[float | None]:
        return [None] * len(rows)

    def draft(self, rows, seq_lens, num_steps=None, roots=None, root_slots=None):
        self.drafts += 1
        steps = min(num_steps or self.num_steps, self.num_steps)
        tokens = roots[:, None]
        sure = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        levels = TreeExpansion(sure, tokens)
        for step in range(1, steps):
            levels.add_children(sure, tokens)
            if step < steps - 1:
                levels.advance()
        return levels.result()


def build(ctx) -> RepeatDrafter:
    return RepeatDrafter(ctx.spec.num_steps)


@pytest.fixture
def repeat_algorithm():
    registry.register(registry.Algorithm("REPEAT", (3, 1, 4), f"{__name__}:build"))
    yield "REPEAT"


def test_a_drafter_from_outside_spectral_serves_plain_decodings_tokens(
    peaky_model_dir, repeat_algorithm
):
    from spectral import Engine

    prompts = [[5, 5, 5, 5, 6], [7, 8, 9], [11, 11, 12, 11, 11]]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    outputs = []
    for spec in (
        {},
        {
            "speculative_algorithm": "repeat",
            "speculative_fixed_tree": True,
            "speculative_max_batch_size": 4,
            "speculative_hybrid_ngram": 0,
        },
    ):
        engine = Engine(model_path=peaky_model_dir, dtype="float32", max_total_tokens=4096, **spec)
        try:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            outputs.append([o["output_ids"] for o in outs])
            assert scheduler_leaks(engine.scheduler) == []
            if spec:
                assert isinstance(engine.worker.drafter, RepeatDrafter)
                assert engine.worker.drafter.drafts > 0
                assert engine.scheduler.stats.spec_verify_ct > 0
        finally:
            engine.shutdown()
    assert outputs[1] == outputs[0]


def test_an_unknown_algorithm_is_refused_naming_the_registered_ones(repeat_algorithm):
    from spectral.args import ServerArgs

    with pytest.raises(ValueError, match="must be one of EAGLE, EAGLE3, .*REPEAT"):
        ServerArgs(speculative_algorithm="SPECULATE")


def algorithm_name_comparisons(path: Path) -> list[str]:
    """`x == "EAGLE3"`, `name in ("NGRAM", ...)`, `spec.algorithm != ...`: each comparison in
    the file with an algorithm's name as spectral spells them (upper case; a draft head's
    checkpoint kind, "eagle3", names a file format) or an `algorithm` attribute on either
    side."""
    names = set(registry.names())

    def names_one(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_one(e) for e in node.elts)
        return isinstance(node, ast.Attribute) and node.attr == "algorithm"

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(
            names_one(side) for side in [node.left, *node.comparators]
        ):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_algorithm_name_is_compared_outside_the_registry_and_the_settings_parser():
    allowed = {SPECTRAL / "speculative" / "registry.py", SPECTRAL / "speculative" / "settings.py"}
    found = [
        hit
        for path in sorted(SPECTRAL.rglob("*.py"))
        if path not in allowed
        for hit in algorithm_name_comparisons(path)
    ]
    assert found == []


def test_the_name_check_finds_what_it_looks_for(tmp_path):
    """The oracle above is not blind: each form of comparison is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        'a = spec.algorithm == "x"\nb = name in ("NGRAM", "other")\nc = "EAGLE3" != kind\n'
        'd = cfg.kind == "eagle3"\n'
    )
    assert [hit.rsplit(":", 1)[1] for hit in algorithm_name_comparisons(sample)] == ["1", "2", "3"]
