"""Write data/preference/: seeded preference pairs about the facts world of data/causal_lm/ (scripts/
make_causal_lm_data.py), for DPO after the SFT recipe.

Each pair asks one question of that world (a colour, an animal's sound, an opposite, a sum) and answers it twice in
the same sentence shape: the chosen answer states the fact, the rejected one a wrong fact of the same kind (another
colour, another sound, another word, a sum off by 1 to 3). The validation pairs ask in the held-out phrasing and about
the sums the training sets never show, so reward accuracy on them (the share of pairs whose chosen answer the policy
prefers over the rejected one, relative to the reference) measures what was learnt beyond the training pairs.

    python scripts/make_preference_data.py            # rewrites data/preference/ identically (seeded)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_causal_lm_data as world  # noqa: E402  (the same facts, phrasings and held-out split)

OUT = Path(__file__).resolve().parent.parent / "data" / "preference"


def other(rng: random.Random, values, right):
    return rng.choice(sorted(set(values) - {right}))


def pair(rng: random.Random, held_out: bool, sums: list[tuple[int, int]]) -> tuple[str, str, str]:
    """One question, its right answer and a wrong one in the same shape; `held_out`: the phrasing (and sum) the
    training sets never show."""
    kind = rng.choice(("colour", "sound", "opposite", "sum"))
    pick = (lambda phrasings: phrasings[-world.HELD_OUT:] if held_out else phrasings[:-world.HELD_OUT])
    if kind == "colour":
        thing = rng.choice(sorted(world.COLOURS))
        right = world.COLOURS[thing]
        question = rng.choice(pick(world.COLOUR_QUESTIONS)).format(x=thing)
        return question, f"The {thing} is {right}.", f"The {thing} is {other(rng, world.COLOURS.values(), right)}."
    if kind == "sound":
        animal = rng.choice(sorted(world.SOUNDS))
        right = world.SOUNDS[animal]
        question = rng.choice(pick(world.SOUND_QUESTIONS)).format(x=animal)
        return question, f"A {animal} {right}.", f"A {animal} {other(rng, world.SOUNDS.values(), right)}."
    if kind == "opposite":
        word = rng.choice(sorted(world.OPPOSITES))
        right = world.OPPOSITES[word]
        question = rng.choice(pick(world.OPPOSITE_QUESTIONS)).format(x=word)
        wrong = other(rng, set(world.OPPOSITES) - {word}, right)
        return question, f"The opposite of {word} is {right}.", f"The opposite of {word} is {wrong}."
    a, b = rng.choice(sums)
    wrong = a + b + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if a + b + d >= 0])
    question = rng.choice(pick(world.SUM_QUESTIONS)).format(a=a, b=b)
    return question, f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."


def row(rng: random.Random, held_out: bool, sums) -> dict:
    """TRL's conversational preference row: the prompt's turns (a system prompt in 30%), then the two answers."""
    question, chosen, rejected = pair(rng, held_out, sums)
    prompt = [{"role": "system", "content": world.SYSTEM}] if rng.random() < 0.3 else []
    prompt.append({"role": "user", "content": question})
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def main() -> None:
    rng = random.Random(20261127)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(20261126).shuffle(pairs)  # the very split of make_causal_lm_data.py (its first shuffle)
    seen_sums, unseen_sums = pairs[:80], pairs[80:]
    OUT.mkdir(parents=True, exist_ok=True)
    world.write(OUT / "train.jsonl", [row(rng, False, seen_sums) for _ in range(1000)])
    world.write(OUT / "validation.jsonl", [row(rng, True, unseen_sums) for _ in range(200)])


if __name__ == "__main__":
    main()
