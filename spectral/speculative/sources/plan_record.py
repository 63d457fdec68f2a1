"""Record: what a tree planner's plans predicted and what its rounds and plain steps took,
summed (/get_server_info's speculative "rounds")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Record:
    """What the plans predicted and what the rounds and plain steps took, summed."""

    rounds: int = 0
    requests: int = 0  # requests in those rounds, summed
    verified_nodes: int = 0  # tree nodes verified (roots included)
    predicted_tokens: float = 0.0
    emitted_tokens: int = 0
    predicted_ms: float = 0.0
    measured_ms: float = 0.0
    plain_ms: float = 0.0  # plain steps of the same batches, as predicted
    plain_steps: int = 0  # plain decode steps while speculation was on
    plain_predicted_ms: float = 0.0
    plain_measured_ms: float = 0.0
    probes: int = 0  # rounds run at no margin after PROBE_EVERY plain steps

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        if self.rounds:
            plain_rate = self.requests / self.plain_ms
            out["predicted_gain"] = self.predicted_tokens / self.predicted_ms / plain_rate
            # Measured rounds against plain steps as measured, where there were any.
            calibration = (
                self.plain_measured_ms / self.plain_predicted_ms if self.plain_steps else 1.0
            )
            out["measured_gain"] = (
                self.emitted_tokens / self.measured_ms / (plain_rate / calibration)
            )
            out["tree_nodes_per_request"] = self.verified_nodes / self.requests
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
