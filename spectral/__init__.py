"""spectral: an LLM serving runtime with EAGLE speculative decoding and a radix cache.

`spectral.Engine` and the DSL names (`function`, `gen`, `select`, the roles, the backends) are
imported lazily: `import spectral` stays cheap, and the DSL can be used without the runtime's
dependencies.
"""

import os
from typing import Any

# Large CPU tensors (weights, KV pool) on transparent huge pages: a decode step streams every
# weight, and each 4 KiB page boundary stops the hardware prefetcher (the default model's batch-1
# decode ran 1.07-1.11x with them). PyTorch's CPU allocator reads this at its first allocation,
# so it holds where spectral is imported before torch allocates; 0 keeps 4 KiB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_LANG_NAMES = (
    "function",
    "gen",
    "select",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "RuntimeEndpoint",
    "OpenAI",
    "set_default_backend",
)

__all__ = ["Engine", "ServerArgs", "SamplingParams", *_LANG_NAMES]


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
    if name in _LANG_NAMES:
        import spectral.lang

        return getattr(spectral.lang, name)
    raise AttributeError(f"module 'spectral' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
