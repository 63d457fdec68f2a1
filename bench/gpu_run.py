"""One run of bench/gpu.py as its parts see it: the options, the models and engines they start,
and the report they add to."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

from bench.gpu_report import Report
from bench.shapes import make_model_dir
from spectral import Engine
from spectral.args import ServerArgs


class Bench:
    """A run's options, its scratch directory `tmp` (models, heads) and its report."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.report = Report(args)

    def model_dir(self, role: str) -> str:
        """The `role` shape's model directory, made on first use."""
        shape = self.args.shapes[role]
        path = self.tmp / "models" / shape
        return str(path) if path.exists() else make_model_dir(path, shape)

    @contextlib.contextmanager
    def engine(self, role: str, batches: list[int], **options) -> Iterator[tuple[Engine, float]]:
        """An engine on the `role` shape for up to max(batches) requests, and its start-up
        seconds (CUDA graphs captured for `batches` where ServerArgs has the flags); shut down
        on leaving (run_parts frees its memory once the part returns)."""
        a = self.args
        fields = {f.name for f in dataclasses.fields(ServerArgs)}
        graphs = dict(
            disable_cuda_graph=False, cuda_graph_max_bs=max(batches), cuda_graph_bs=sorted(batches)
        )
        tokens = max(batches) * (a.prompt_len + a.new_tokens + 16) + 4096
        start = time.perf_counter()
        engine = Engine(
            model_path=self.model_dir(role),
            dtype=a.dtype,
            device=a.device,
            attention_backend=a.backend,
            load_format="dummy",
            disable_radix_cache=True,
            disable_cpu_kernels=a.device == "cpu",  # the CPU run checks logic, not speed
            max_running_requests=max(batches),
            max_total_tokens=tokens,
            **{k: v for k, v in graphs.items() if k in fields},
            **options,
        )
        try:
            yield engine, round(time.perf_counter() - start, 2)
        finally:
            engine.shutdown()
