"""How roles are rendered into the prompt text.

The server does not publish its chat template, so the backends render ChatML (the default
model's) unless given another `ChatTemplate`. Unlike the default model's own template and the
server's chat API, `CHATML` adds no system message to a conversation without one: a program
that starts with `system(...)` renders the same prompt both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """`role_begin`/`role_end` are format strings with a `{role}` field."""

    name: str
    role_begin: str
    role_end: str
    default_system_prompt: str | None = None

    def begin(self, role: str) -> str:
        return self.role_begin.format(role=role)

    def end(self, role: str) -> str:
        return self.role_end.format(role=role)


CHATML = ChatTemplate(name="chatml", role_begin="<|im_start|>{role}\n", role_end="<|im_end|>\n")
