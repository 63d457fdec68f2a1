"""When a stage fails on one request: what its client is told, and fault injection for tests
(`--fault-injection`: the stages named fail on purpose for chosen requests).
"""

from __future__ import annotations

FAULT_STAGES = ("detokenizer", "scheduler", "worker")
_enabled: set[str] = set()


def parse_stages(stages: str | None) -> set[str]:
    """The stage names of a comma-separated list; ValueError for one that is not a stage."""
    names = {s for s in (stages or "").split(",") if s}
    unknown = names - set(FAULT_STAGES)
    if unknown:
        raise ValueError(f"unknown fault stages {sorted(unknown)}; known: {FAULT_STAGES}")
    return names


def enable(stages: str | None) -> None:
    """Make the comma-separated `stages` fail on purpose in this process (None: none)."""
    _enabled.clear()
    _enabled.update(parse_stages(stages))


class InjectedFault(RuntimeError):
    pass


class RemoteError(RuntimeError):
    """An error raised in another process, carried back as text that names its type."""


class WorkerLostError(RuntimeError):
    """The worker is gone (not: it failed on one batch). Nothing can run; the scheduler
    lets this through instead of failing the batch's requests."""


def inject(stage: str, rid: str) -> None:
    """Raise InjectedFault where `stage` is enabled and the request id starts with
    `fault-<stage>`; off (always, outside tests) a lookup in an empty set."""
    if stage in _enabled and rid.startswith(f"fault-{stage}"):
        raise InjectedFault(f"fault injected in the {stage} for request {rid}")


def failure(stage: str, err: BaseException) -> str:
    """What a client is told when `stage` fails on its request."""
    why = str(err) if isinstance(err, RemoteError) else f"{type(err).__name__}: {err}"
    return f"the {stage} failed on this request: {why}"
