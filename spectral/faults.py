"""When a stage fails on one request: what its client is told, and fault injection for tests
(the stages fail on purpose for chosen requests).

`SPECTRAL_FAULTS` names stages (comma-separated: detokenizer, scheduler, worker); a stage
named there raises `InjectedFault` while it handles a request whose id starts with
`fault-<stage>`. Unset (always, outside tests), `inject` is a set lookup that finds nothing.
"""

from __future__ import annotations

import os

STAGES = frozenset(s for s in os.environ.get("SPECTRAL_FAULTS", "").split(",") if s)


class InjectedFault(RuntimeError):
    pass


def inject(stage: str, rid: str) -> None:
    if stage in STAGES and rid.startswith(f"fault-{stage}"):
        raise InjectedFault(f"fault injected in the {stage} for request {rid}")


def failure(stage: str, err: BaseException) -> str:
    """What a client is told when `stage` fails on its request."""
    why = str(err) if type(err).__name__ == "WorkerStepError" else f"{type(err).__name__}: {err}"
    return f"the {stage} failed on this request: {why}"
