"""The frontend language: SGLang-style programs over a state `s`.

    import spectral as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is the capital of France?")["answer"])

This package talks to servers over HTTP and imports nothing else from `spectral`, so it can be
used without the runtime's dependencies.
"""

from spectral.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from spectral.lang.backends import OpenAI, RuntimeEndpoint
from spectral.lang.backends.base import Backend, BackendError
from spectral.lang.chat_template import CHATML, ChatTemplate
from spectral.lang.fork import ProgramStateGroup
from spectral.lang.interpreter import Function, set_default_backend
from spectral.lang.state import ProgramState

__all__ = [
    "CHATML",
    "Backend",
    "BackendError",
    "ChatTemplate",
    "Function",
    "OpenAI",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]
