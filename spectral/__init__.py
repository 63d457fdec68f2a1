"""spectral: an LLM serving runtime with EAGLE speculative decoding and a radix cache.

`spectral.Engine` is imported lazily so the DSL can be used without the runtime's dependencies.
"""

from typing import Any

__all__ = ["Engine", "ServerArgs", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from spectral.engine import Engine

        return Engine
    if name == "ServerArgs":
        from spectral.args import ServerArgs

        return ServerArgs
    if name == "SamplingParams":
        from spectral.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'spectral' has no attribute {name!r}")
