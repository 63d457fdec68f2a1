"""A two-turn chat: the second question sees the first answer. The first reply is streamed.

python examples/two_turn_chat.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import spectral as sgl


@sgl.function
def two_turns(s, first: str, second: str):
    s += sgl.system("You are a helpful assistant. Keep answers short.")
    s += sgl.user(first)
    s += sgl.assistant(sgl.gen("first_answer", max_tokens=64))
    s += sgl.user(second)
    s += sgl.assistant(sgl.gen("second_answer", max_tokens=64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))

    state = two_turns.run(
        first="Name a planet in the solar system.",
        second="How far is it from the Sun?",
        temperature=0,
        stream=True,
    )
    for piece in state.text_iter("first_answer"):
        print(piece, end="", flush=True)
    print()
    for message in state.messages():
        print(f"[{message['role']}] {message['content']}")


if __name__ == "__main__":
    main()
