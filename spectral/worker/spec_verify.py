"""The host's side of verifying a round: each request's logits adjusted per tree node as plain
decoding would adjust them (penalties, banned tokens, a grammar's mask), a path accepted by
greedy or the lossless sampling rule, and the worker's result with the emitted tokens'
logprobs. Rounds the device verifies alone skip it (spec_worker's `_round_on_device`)."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from spectral.constrained import apply_bitmask
from spectral.core.worker_io import RequestSampling, WorkerResult
from spectral.speculative.tree import DraftTrees
from spectral.speculative.verify import VerifyResult, verify_greedy, verify_sampling
from spectral.worker.sampler import (
    apply_penalties,
    argmax_rows,
    filtered_probs,
    request_step_seed,
)


def verify_trees(
    trees: DraftTrees,
    logits: torch.Tensor,
    sizes: list[int],
    sampling: list[RequestSampling],
    masks: dict[int, torch.Tensor] | None = None,
    kernels: ModuleType | None = None,
    report_node_choices: bool = False,
) -> VerifyResult:
    """Accept a path per request: greedy requests by argmax, others by the lossless
    sampling rule, both on logits adjusted per node as plain decoding would adjust them
    (penalties, then the grammar's mask where `masks` has the request's)."""
    B, n = trees.tokens.shape
    vocab = logits.shape[-1]
    accepted: list[list[int]] = [[] for _ in range(B)]
    emitted: list[list[int]] = [[] for _ in range(B)]
    greedy_rows = [b for b, s in enumerate(sampling) if s.params.is_greedy]
    sampled_rows = [b for b, s in enumerate(sampling) if not s.params.is_greedy]
    # per request its rows of logits adjusted, or None where nothing adjusts them (its rows
    # are sliced only where read: a round's tiny tensor operations cost it more than its walk)
    adjusted: list[torch.Tensor | None] = []
    starts: list[int] = []
    offset = 0
    for b, size in enumerate(sizes):
        starts.append(offset)
        node_sampling = _node_sampling(trees, b, size, sampling[b])
        masked = bool(masks) and b in masks
        block = None
        if node_sampling is not None or masked:
            raw = block = logits[offset : offset + size]
            if node_sampling is not None:
                block = apply_penalties(block, node_sampling)  # a copy where it changes any
            if masked:  # in place, on a copy: the logprobs read the raw logits
                block = apply_bitmask(block.clone() if block is raw else block, masks[b], kernels)
            if block is raw:  # nothing changed it
                block = None
        adjusted.append(block)
        offset += size

    def rows(b: int) -> torch.Tensor:
        block = adjusted[b]
        return logits[starts[b] : starts[b] + sizes[b]] if block is None else block

    # the target's choice after each node: greedy verification's, and what a round that
    # reports node choices reports for every request
    chosen_rows = range(B) if report_node_choices else greedy_rows
    if all(block is None for block in adjusted):  # one call over every node
        everyone = argmax_rows(logits[:offset], kernels).tolist()
        choices = {b: everyone[starts[b] : starts[b] + sizes[b]] for b in chosen_rows}
    else:
        choices = {b: argmax_rows(rows(b), kernels).tolist() for b in chosen_rows}
    if greedy_rows:
        ids = [choices[b] + [-1] * (n - sizes[b]) for b in greedy_rows]
        part = verify_greedy(trees if len(greedy_rows) == B else _select(trees, greedy_rows), ids)
        for i, b in enumerate(greedy_rows):
            accepted[b], emitted[b] = part.accepted[i], part.emitted[i]
    if sampled_rows:
        probs = torch.zeros((len(sampled_rows), n, vocab), device=logits.device)
        generators: list[torch.Generator | None] = []
        for i, b in enumerate(sampled_rows):
            s = sampling[b]
            probs[i, : sizes[b]] = filtered_probs(rows(b), [s] * sizes[b])
            probs[i, sizes[b] :, 0] = 1.0  # padding rows: never reached
            gen = None
            if s.params.seed is not None:
                seed = request_step_seed(s.params.seed, len(s.output_ids))
                gen = torch.Generator().manual_seed(seed)
            generators.append(gen)
        # The walk runs on the host: one copy of the filtered distributions.
        probs = probs.cpu()
        part = verify_sampling(_select(trees, sampled_rows), probs, generators=generators)
        for i, b in enumerate(sampled_rows):
            accepted[b], emitted[b] = part.accepted[i], part.emitted[i]
    node_next = [choices[b] for b in range(B)] if report_node_choices else []
    return VerifyResult(accepted, emitted, node_next)


def round_result(
    verdict: VerifyResult,
    logits: torch.Tensor,
    offsets: list[int],
    sampling: list[RequestSampling],
) -> WorkerResult:
    emitted_logprobs: list[list[float] | None] = []
    emitted_top: list[list[list[tuple[float, int]]] | None] = []
    for b, s in enumerate(sampling):
        if not (s.return_logprob or s.top_logprobs_num):
            emitted_logprobs.append(None)
            emitted_top.append(None)
            continue
        rows = torch.tensor(verdict.accepted[b]) + offsets[b]
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        chosen = torch.tensor(verdict.emitted[b], device=logits.device)
        emitted_logprobs.append(logprobs.gather(1, chosen[:, None])[:, 0].tolist())
        if s.top_logprobs_num:
            values, ids = logprobs.topk(s.top_logprobs_num, dim=-1)
            emitted_top.append([list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())])
        else:
            emitted_top.append(None)
    return WorkerResult(
        next_token_ids=[e[0] for e in verdict.emitted],
        logprobs=[lp[0] if lp else None for lp in emitted_logprobs],
        top_logprobs=[t[0] if t else None for t in emitted_top],
        accepted_nodes=verdict.accepted,
        emitted_ids=verdict.emitted,
        emitted_logprobs=emitted_logprobs,
        emitted_top_logprobs=emitted_top,
        node_next_ids=verdict.node_next,
    )


def _select(trees: DraftTrees, rows: list[int]) -> DraftTrees:
    """The trees of `rows` only."""
    index = torch.tensor(rows)
    return DraftTrees(
        tokens=trees.tokens[index],
        parents=trees.parents[index],
        depths=trees.depths[index],
        mask=trees.mask[index],
        next_token=trees.next_token[index],
        next_sibling=trees.next_sibling[index],
        num_nodes=[trees.num_nodes[r] for r in rows],
    )


def _node_sampling(
    trees: DraftTrees, b: int, size: int, s: RequestSampling
) -> list[RequestSampling] | None:
    """Per tree node, the sampling state plain decoding would have there: the output so far
    extended by the node's path (penalties count it), and banned tokens while the output is
    shorter than min_new_tokens. None when nothing depends on the node."""
    if not (s.params.has_penalties or s.banned_token_ids):
        return None
    parents = trees.parents[b].tolist()
    tokens = trees.tokens[b].tolist()
    out: list[RequestSampling] = []
    for j in range(size):
        path: list[int] = []
        node = j
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        output = s.output_ids + path[::-1]
        banned = s.banned_token_ids if len(output) < s.params.min_new_tokens else []
        out.append(dataclasses.replace(s, output_ids=output, banned_token_ids=banned))
    return out
