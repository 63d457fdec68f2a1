"""How roles are rendered into the prompt text.

The server does not publish its tokenizer's chat template, so the runtime backend renders
ChatML, the template of the default model (SmolLM2-135M-Instruct):

    <|im_start|>user\\nHello<|im_end|>\\n

Pass another `ChatTemplate` to the backend for a model with a different template.

One difference from SmolLM2's own template: that one adds a system message ("You are a helpful
AI assistant named SmolLM, ...") when a conversation has none, and so does the server's
`/v1/chat/completions`; `CHATML` adds nothing. A program that starts with `system(...)`
renders the same prompt both ways.
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
