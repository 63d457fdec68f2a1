"""Cases for spectral's Triton kernels and backend, run by tests/test_triton_attention.py in a
process of their own: Triton's interpreter must be chosen (TRITON_INTERPRET=1) before triton
is imported, which the test process may have done already."""

from __future__ import annotations

import random
import sys

from spectral.attention.torch_backend import TorchAttentionBackend
from spectral.attention.triton_backend import TritonAttentionBackend
from tests.attention_cases import CASES, SHAPES, AttentionCase, random_case

TOLERANCE = 1e-5


def max_error(case: AttentionCase) -> float:
    """Largest difference between the Triton backend (`row_attention` for DECODE, the tiled
    `extend_attention` for the other modes) and the torch backend (SDPA under its masks) for
    one batch. Both write the same new keys into the pool."""
    torch_backend = TorchAttentionBackend(case.pool, case.table, case.scaling, kernels=None)
    torch_backend.init_forward_metadata(case.batch)
    expected = torch_backend.forward(case.q, case.k, case.v, 0, case.batch)
    triton_backend = TritonAttentionBackend(case.pool, case.table, case.scaling)
    triton_backend.init_forward_metadata(case.batch)
    got = triton_backend.forward(case.q, case.k, case.v, 0, case.batch)
    return float((got - expected).abs().max())


def engines_agree() -> bool:
    """An Engine with --attention-backend triton gives the torch backend's greedy tokens on a
    tiny model with sharp distributions, plainly and with EAGLE3 (a random head, every step a
    tree round)."""
    import tempfile
    from pathlib import Path

    from spectral import Engine
    from spectral.models.resolve import resolve_model_path
    from tests.conftest import make_tiny_model
    from tests.test_speculative import make_random_head

    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_model(
        tmp / "model",
        resolve_model_path("default"),
        seed=1,
        initializer_range=1.0,
        max_position_embeddings=2048,
    )
    eagle3 = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": make_random_head(tmp / "head", model, "eagle3"),
        "speculative_fixed_tree": True,
        "speculative_max_batch_size": 4,
    }
    prompts = [[5, 6, 7, 8, 9], [12, 13]]
    outputs = []
    for backend, spec in (("torch", {}), ("triton", {}), ("triton", eagle3)):
        engine = Engine(
            model_path=model,
            dtype="float32",
            max_total_tokens=1024,
            attention_backend=backend,
            **spec,
        )
        outs = engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 4}
        )
        rounds = engine.scheduler.stats.spec_verify_ct
        engine.shutdown()
        outputs.append([o["output_ids"] for o in outs])
        print(f"engine, {backend} attention, {'EAGLE3' if spec else 'plain'}: {outputs[-1]}")
        if spec and rounds == 0:
            print("no speculative round ran")
            return False
    return all(out == outputs[0] for out in outputs)


def tail_error() -> float:
    """Largest difference between `row_attention` with a tail (each row over its table row's
    prefix, then slots of its own: a draft tree's ancestors) and the same rows gathered for
    SDPA (attention.rows without a GPU), in float32, GQA."""
    import torch

    from spectral.attention.rows import explicit_rows, slot_list_attention
    from spectral.kernels.triton.attention import row_attention

    torch.manual_seed(0)
    k_pool, v_pool = torch.randn(2, 200, 2, 64).unbind(0)
    table = torch.randint(1, 200, (4, 70))
    rows, seq_lens = torch.tensor([0, 0, 2, 3, 1]), torch.tensor([1, 33, 70, 5, 64])
    tail = torch.randint(1, 200, (5, 3))
    q = torch.randn(5, 8, 64)
    got = row_attention(q, k_pool, v_pool, table, seq_lens, 0.125, rows, tail)
    indices, lens = explicit_rows(table, rows, seq_lens, tail)
    expected = slot_list_attention(q, k_pool, v_pool, indices, lens, 0.125)
    return float((got - expected).abs().max())


def main() -> int:
    rng = random.Random(0)
    errors = []
    for heads, kv_heads, head_dim in SHAPES:
        for mode, prefixes, news in CASES:
            err = max_error(random_case(rng, mode, prefixes, news, heads, kv_heads, head_dim))
            print(
                f"{mode.name:14s} {prefixes}/{news} heads {heads}/{kv_heads} dim {head_dim}: "
                f"max error {err:.2e}"
            )
            errors.append(err)
    errors.append(tail_error())
    print(f"rows with a tail: max error {errors[-1]:.2e}")
    # each error on its own: a NaN fails its comparison (max() would drop it)
    within = [err <= TOLERANCE for err in errors]
    return 0 if all(within) and engines_agree() else 1


if __name__ == "__main__":
    sys.exit(main())
