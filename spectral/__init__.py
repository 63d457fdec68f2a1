"""spectral: an LLM serving runtime with EAGLE speculative decoding and a radix cache.

`spectral.Engine` and the DSL names (`function`, `gen`, `select`, the roles, the backends) are
imported lazily: `import spectral` stays cheap, and the DSL can be used without the runtime's
dependencies.
"""

from typing import Any

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
