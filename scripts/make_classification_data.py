"""Generate the small, deterministic sentiment-classification set shipped in data/classification/."""

import argparse
import json
import random
from pathlib import Path

SUBJECTS = ["this movie", "the film", "the sequel", "this documentary", "the show", "this novel",
            "this album", "this game", "this phone", "the blender", "this laptop", "the camera",
            "the jacket", "this coffee maker", "the vacuum cleaner", "the keyboard", "the tent",
            "the backpack", "this mattress", "the speaker"]
ASPECTS = ["the acting", "the battery life", "the packaging", "the soundtrack", "the price",
           "the design", "the ending", "the customer service", "the build quality", "the screen",
           "the dialogue", "the setup", "the manual", "the pacing", "the color"]
POS_ADJ = ["great", "excellent", "wonderful", "fantastic", "superb", "delightful", "brilliant",
           "charming", "impressive", "enjoyable", "solid", "reliable", "sturdy", "beautiful",
           "clever", "engaging", "moving", "hilarious", "smooth", "comfortable", "elegant",
           "polished", "thoughtful", "satisfying", "terrific", "outstanding", "lovely", "fun",
           "refreshing", "gripping", "heartfelt", "durable", "intuitive", "flawless", "good"]
NEG_ADJ = ["terrible", "awful", "boring", "dull", "disappointing", "flimsy", "cheap", "broken",
           "clumsy", "tedious", "mediocre", "bland", "confusing", "sloppy", "annoying",
           "unreliable", "overpriced", "forgettable", "predictable", "shallow", "noisy", "fragile",
           "painful", "weak", "lifeless", "frustrating", "ugly", "messy", "pointless", "dreadful",
           "poor", "uncomfortable", "slow", "buggy", "bad"]
POS_VP = ["I loved every minute of it", "it exceeded my expectations", "I would buy it again",
          "it works exactly as promised", "I highly recommend it", "it kept me hooked",
          "it was worth every penny", "my whole family enjoyed it", "I keep coming back to it",
          "it made my day", "I have already told my friends about it", "it feels built to last"]
NEG_VP = ["I regret buying it", "it fell apart within a week", "I want my money back",
          "it stopped working after a few days", "I would not recommend it", "it wasted my evening",
          "I returned it the next day", "nobody in my family liked it", "I gave up halfway through",
          "it left me annoyed", "I warned my friends to stay away", "it feels like a cheap copy"]
FILLERS = ["I watched it last weekend with my brother", "I bought it on sale in March",
           "it arrived two days after I ordered it", "I have been using it for about a month",
           "a friend suggested it to me", "we saw it at the local theater on a Tuesday",
           "I picked it up at the mall", "it came in a plain brown box",
           "I tried it after reading a few reviews", "the store was quite busy that day",
           "I got it as a birthday present", "we finished it late on a rainy night",
           "my neighbor has the same one", "I used it mostly in the kitchen",
           "it was the first thing I noticed"]
INTENSIFIERS = ["", "really ", "quite ", "very ", "truly ", "pretty ", "surprisingly "]
NEGATORS = ["not ", "not at all ", "far from ", "never ", "not really "]
TEMPLATES = ["{F}, and {s} was {a}.", "{S} was {a}, and {v}.", "{F}. {S} turned out to be {a}.",
             "Honestly, {s} was {a} and {v}.", "I thought {s} was {a}; {F}.",
             "{F}, and honestly {v}.", "Overall {s} felt {a}, and {x} was {b} too.",
             "{S} was {a}. {Fc}, and {v}."]
CONTRAST = "Although {x} was {b}, "
SPLITS = {"train": 2400, "validation": 400, "test": 400}
MAJORITY_SHARE, NOISE_RATE, NEGATION_RATE, CONTRAST_RATE = 0.60, 0.05, 0.20, 0.15


def adj_phrase(rng, positive, negate):
    """An adjective phrase with the given polarity, optionally built by negating the opposite."""
    if negate:  # "not bad" reads positive, "not good" reads negative
        return rng.choice(NEGATORS) + rng.choice(NEG_ADJ if positive else POS_ADJ)
    return rng.choice(INTENSIFIERS) + rng.choice(POS_ADJ if positive else NEG_ADJ)


def make_sentence(rng, positive):
    """One review-like sentence whose overall sentiment is `positive`."""
    negate = rng.random() < NEGATION_RATE
    slots = {"s": rng.choice(SUBJECTS), "F": rng.choice(FILLERS), "x": rng.choice(ASPECTS),
             "a": adj_phrase(rng, positive, negate), "b": adj_phrase(rng, positive, False),
             "v": rng.choice(POS_VP if positive else NEG_VP)}
    template = rng.choice(TEMPLATES)
    if negate and "{a}" not in template:  # keep the negation rate honest
        template = rng.choice([t for t in TEMPLATES if "{a}" in t])
    text = template.format(S=slots["s"].capitalize(), Fc=slots["F"][0].upper() + slots["F"][1:],
                           **slots)
    if rng.random() < CONTRAST_RATE:  # a clashing aside the model must learn to discount
        aside = CONTRAST.format(x=rng.choice(ASPECTS), b=adj_phrase(rng, not positive, False))
        text = aside + (text if text.startswith("I ") else text[0].lower() + text[1:])
    return text[0].upper() + text[1:]


def make_split(rng, size, seen):
    """`size` unique examples, exactly MAJORITY_SHARE labelled 0 and NOISE_RATE with flipped text."""
    n_neg, n_noisy = round(size * MAJORITY_SHARE), round(size * NOISE_RATE)
    labels = [0] * n_neg + [1] * (size - n_neg)
    noisy = [True] * n_noisy + [False] * (size - n_noisy)
    rng.shuffle(labels)
    rng.shuffle(noisy)
    rows = []
    for label, flip in zip(labels, noisy):
        while True:  # regenerate on a duplicate or an out-of-range length
            sentence = make_sentence(rng, positive=(label == 1) != flip)
            if sentence not in seen and 8 <= len(sentence.split()) <= 30:
                break
        seen.add(sentence)
        rows.append({"sentence": sentence, "label": label})
    return rows


def main():
    default_dir = Path(__file__).resolve().parent.parent / "data" / "classification"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", type=Path, default=default_dir)
    args = parser.parse_args()

    rng, seen, total_bytes = random.Random(args.seed), set(), 0
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for split, size in SPLITS.items():
        rows = make_split(rng, size, seen)
        path = args.output_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        total_bytes += path.stat().st_size
        neg = sum(r["label"] == 0 for r in rows)
        print(f"{split}: {len(rows)} examples, label 0: {neg} ({neg / len(rows):.1%}), "
              f"label 1: {len(rows) - neg} ({1 - neg / len(rows):.1%}), "
              f"majority baseline {max(neg, len(rows) - neg) / len(rows):.3f}")
    assert len(seen) == sum(SPLITS.values()), "duplicate sentences across splits"
    assert total_bytes < 1_000_000, f"dataset too large: {total_bytes} bytes"
    print(f"total size: {total_bytes / 1024:.1f} KiB in {args.output_dir}")


if __name__ == "__main__":
    main()
