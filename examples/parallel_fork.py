"""Parallel branches: fork the state, let each branch write its own tip (the branches run
concurrently and share the prompt's KV cache on the server), then join and summarise.

    python examples/parallel_fork.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import spectral as sgl

ASPECTS = ["sleep", "food", "exercise"]


@sgl.function
def health_tips(s, topic: str):
    s += f"Three tips about {topic}, one short sentence each.\n"
    forks = s.fork(len(ASPECTS))
    for aspect, branch in zip(ASPECTS, forks):
        branch += f"- {aspect.capitalize()}:" + sgl.gen("tip", max_tokens=32, stop="\n")
    forks.join()
    for aspect, tip in zip(ASPECTS, s["tip"]):
        s += f"- {aspect.capitalize()}:{tip}\n"
    s += "Summary:" + sgl.gen("summary", max_tokens=48, stop="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))

    state = health_tips.run(topic="staying healthy", temperature=0)
    print(state.text())


if __name__ == "__main__":
    main()
