"""Write data/causal_lm/: a small seeded chat set a tiny model learns in a few hundred steps on a CPU.

Questions about a fixed world of facts (colours of things, sounds of animals, opposites, sums of small numbers),
asked in several phrasings, answered in one fixed sentence shape. The validation set asks held-out phrasings of the
same facts and sums the training set never shows, so its next-token accuracy on the answers measures what was learnt
beyond memorising lines. Also written: the same kind of data as prompt/completion and as plain text rows (the other
two formats the recipe reads).

    python scripts/make_causal_lm_data.py            # rewrites data/causal_lm/ identically (seeded)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "causal_lm"

COLOURS = {"banana": "yellow", "lemon": "yellow", "tomato": "red", "cherry": "red", "strawberry": "red",
           "grass": "green", "leaf": "green", "lime": "green", "sky": "blue", "sea": "blue", "coal": "black",
           "crow": "black", "snow": "white", "milk": "white", "orange": "orange", "carrot": "orange",
           "plum": "purple", "grape": "purple", "chocolate": "brown", "bark": "brown"}
SOUNDS = {"dog": "barks", "cat": "meows", "cow": "moos", "duck": "quacks", "lion": "roars", "sheep": "bleats",
          "horse": "neighs", "owl": "hoots", "frog": "croaks", "bee": "buzzes", "snake": "hisses", "wolf": "howls"}
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "early": "late", "light": "dark",
             "happy": "sad", "open": "closed", "full": "empty", "old": "new", "hard": "soft", "high": "low"}
OPPOSITES.update({value: key for key, value in list(OPPOSITES.items())})

COLOUR_QUESTIONS = ["What colour is the {x}?", "Which colour does the {x} have?", "Tell me the colour of the {x}.",
                    "What is the colour of the {x}?", "Name the colour of the {x}."]
SOUND_QUESTIONS = ["What sound does a {x} make?", "How does a {x} sound?", "Which noise does a {x} make?",
                   "What does a {x} say?", "Tell me the sound of a {x}."]
OPPOSITE_QUESTIONS = ["What is the opposite of {x}?", "Give the opposite of {x}.", "Which word means the opposite "
                      "of {x}?", "Name the opposite of {x}.", "What word is opposite to {x}?"]
SUM_QUESTIONS = ["What is {a} plus {b}?", "Add {a} and {b}.", "How much is {a} plus {b}?", "Compute {a} + {b}.",
                 "What do {a} and {b} make?"]
HELD_OUT = 1  # the last phrasing of each kind is asked in validation only
SYSTEM = "You are a short and exact assistant."


def qa(rng: random.Random, held_out: bool, sums: list[tuple[int, int]]) -> tuple[str, str]:
    """One question and its answer; `held_out`: a phrasing (and sum) the training set never shows."""
    kind = rng.choice(("colour", "sound", "opposite", "sum"))
    pick = (lambda phrasings: phrasings[-HELD_OUT:] if held_out else phrasings[:-HELD_OUT])
    if kind == "colour":
        thing = rng.choice(sorted(COLOURS))
        return rng.choice(pick(COLOUR_QUESTIONS)).format(x=thing), f"The {thing} is {COLOURS[thing]}."
    if kind == "sound":
        animal = rng.choice(sorted(SOUNDS))
        return rng.choice(pick(SOUND_QUESTIONS)).format(x=animal), f"A {animal} {SOUNDS[animal]}."
    if kind == "opposite":
        word = rng.choice(sorted(OPPOSITES))
        return rng.choice(pick(OPPOSITE_QUESTIONS)).format(x=word), f"The opposite of {word} is {OPPOSITES[word]}."
    a, b = rng.choice(sums)
    return rng.choice(pick(SUM_QUESTIONS)).format(a=a, b=b), f"{a} plus {b} is {a + b}."


def conversation(rng: random.Random, held_out: bool, sums) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    for _ in range(1 if rng.random() < 0.7 else 2):  # some two-turn conversations
        question, answer = qa(rng, held_out, sums)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    rng = random.Random(20261126)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    seen_sums, unseen_sums = pairs[:80], pairs[80:]
    OUT.mkdir(parents=True, exist_ok=True)
    write(OUT / "train.jsonl", [{"messages": conversation(rng, False, seen_sums)} for _ in range(2000)])
    write(OUT / "validation.jsonl", [{"messages": conversation(rng, True, unseen_sums)} for _ in range(200)])
    prompt_completion = []
    for _ in range(300):
        question, answer = qa(rng, False, seen_sums)
        prompt_completion.append({"prompt": f"Question: {question}\nAnswer: ", "completion": answer})
    write(OUT / "prompt_completion.jsonl", prompt_completion)
    text = []
    for _ in range(300):
        question, answer = qa(rng, False, seen_sums)
        text.append({"text": f"Question: {question}\nAnswer: {answer}"})
    write(OUT / "text.jsonl", text)


if __name__ == "__main__":
    main()
