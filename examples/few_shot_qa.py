"""Few-shot question answering: worked examples, then the question, then a one-line answer.

spectral serve &   # or: make serve
python examples/few_shot_qa.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import spectral as sgl

EXAMPLES = [
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"),
]


@sgl.function
def few_shot_qa(s, question: str):
    for example_question, example_answer in EXAMPLES:
        s += f"Q: {example_question}\nA: {example_answer}\n"
    s += f"Q: {question}\nA:" + sgl.gen("answer", max_tokens=16, stop="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))

    questions = ["What is the capital of France?", "What is the capital of Spain?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0)
    for question, state in zip(questions, states):
        print(f"{question} ->{state['answer']}")


if __name__ == "__main__":
    main()
