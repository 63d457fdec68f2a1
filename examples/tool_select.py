"""Tool choice with select: the model picks one tool name from a fixed list (scored by the
server's token logprobs, not parsed from free text), then writes the tool's input.

    python examples/tool_select.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import spectral as sgl

TOOLS = {
    "calculator": "evaluates arithmetic",
    "search": "looks facts up on the web",
    "weather": "gives the forecast for a city",
}


@sgl.function
def choose_tool(s, request: str):
    tools = "\n".join(f"- {name}: {what}" for name, what in TOOLS.items())
    s += sgl.system(f"You route requests to one of these tools:\n{tools}")
    s += sgl.user(request)
    s += sgl.assistant_begin()
    s += "Tool: " + sgl.select("tool", choices=list(TOOLS)) + "\n"
    s += "Input:" + sgl.gen("tool_input", max_tokens=24, stop="\n")
    s += sgl.assistant_end()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))

    requests = [
        "What is 17 times 23?",
        "Will it rain in Paris tomorrow?",
        "Who wrote the novel Dune?",
    ]
    states = choose_tool.run_batch([{"request": r} for r in requests], temperature=0)
    for request, state in zip(requests, states):
        scores = state.get_meta_info("tool")["normalized_prompt_logprobs"]
        ranked = ", ".join(f"{name} {score:.2f}" for name, score in zip(TOOLS, scores))
        print(f"{request}\n  tool: {state['tool']} ({ranked})\n  input:{state['tool_input']}")


if __name__ == "__main__":
    main()
