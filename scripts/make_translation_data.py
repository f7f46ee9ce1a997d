"""Generate the small, deterministic English -> German-like parallel set shipped in data/translation/."""

import argparse
import json
import random
from pathlib import Path

# English noun -> (German-like noun, gender): gender decides article and adjective endings.
NOUNS = {"man": ("mann", "m"), "woman": ("frau", "f"), "child": ("kind", "n"), "dog": ("hund", "m"),
         "cat": ("katze", "f"), "horse": ("pferd", "n"), "teacher": ("lehrer", "m"), "bird": ("vogel", "m"),
         "house": ("haus", "n"), "car": ("auto", "n"), "book": ("buch", "n"), "apple": ("apfel", "m"),
         "door": ("tuer", "f"), "table": ("tisch", "m"), "letter": ("brief", "m"), "flower": ("blume", "f"),
         "city": ("stadt", "f"), "king": ("koenig", "m"), "queen": ("koenigin", "f"), "farmer": ("bauer", "m"),
         "girl": ("maedchen", "n"), "boy": ("junge", "m"), "friend": ("freund", "m"), "mouse": ("maus", "f"),
         "tree": ("baum", "m"), "ship": ("schiff", "n"), "song": ("lied", "n"), "picture": ("bild", "n"),
         "key": ("schluessel", "m"), "cake": ("kuchen", "m"), "bottle": ("flasche", "f")}
ADJECTIVES = {"old": "alt", "young": "jung", "small": "klein", "big": "gross", "red": "rot", "green": "gruen",
              "new": "neu", "fast": "schnell", "happy": "froh", "tired": "muede", "beautiful": "schoen",
              "strange": "seltsam"}
VERBS = {"saw": "sah", "found": "fand", "bought": "kaufte", "sold": "verkaufte", "visited": "besuchte",
         "painted": "malte", "carried": "trug", "opened": "oeffnete", "lost": "verlor", "loved": "liebte",
         "called": "rief", "heard": "hoerte", "liked": "mochte", "took": "nahm", "met": "traf", "washed": "wusch"}
TIMES = {"yesterday": "gestern", "today": "heute", "later": "spaeter", "often": "oft", "then": "dann",
         "suddenly": "ploetzlich"}
PLACES = {"garden": ("garten", "m"), "park": ("park", "m"), "kitchen": ("kueche", "f"), "school": ("schule", "f"),
          "forest": ("wald", "m"), "village": ("dorf", "n"), "market": ("markt", "m"), "church": ("kirche", "f")}
CLAUSES = {"i think that": "ich denke, dass", "she says that": "sie sagt, dass", "we know that": "wir wissen, dass",
           "he believes that": "er glaubt, dass"}
# (definite, case) -> article per gender; adjective endings follow the same key.
ARTICLES = {(True, "nom"): {"m": "der", "f": "die", "n": "das"}, (True, "acc"): {"m": "den", "f": "die", "n": "das"},
            (False, "nom"): {"m": "ein", "f": "eine", "n": "ein"},
            (False, "acc"): {"m": "einen", "f": "eine", "n": "ein"}}
ENDINGS = {(True, "nom"): {"m": "e", "f": "e", "n": "e"}, (True, "acc"): {"m": "en", "f": "e", "n": "e"},
           (False, "nom"): {"m": "er", "f": "e", "n": "es"}, (False, "acc"): {"m": "en", "f": "e", "n": "es"}}


def noun_phrase(rng):
    """One English noun phrase and a function rendering it in German-like for a case."""
    noun, definite = rng.choice(sorted(NOUNS)), rng.random() < 0.6
    adjective = rng.choice(sorted(ADJECTIVES)) if rng.random() < 0.5 else None
    words = [adjective, noun] if adjective else [noun]
    article = "the" if definite else ("an" if words[0][0] in "aeiou" else "a")
    english = " ".join([article, *words])
    german_noun, gender = NOUNS[noun]

    def german(case):
        key = (definite, case)
        stem = ADJECTIVES[adjective].removesuffix("e") if adjective else ""  # muede + en -> mueden
        adjective_form = [stem + ENDINGS[key][gender]] if adjective else []
        return " ".join([ARTICLES[key][gender], *adjective_form, german_noun])

    return english, german


def sentence_pair(rng):
    """English clause with optional time adverb, place and reporting clause; German-like word order: verb
    second (after a fronted adverb the verb precedes the subject), verb last after "dass"."""
    (subject_en, subject_de), (object_en, object_de) = noun_phrase(rng), noun_phrase(rng)
    verb = rng.choice(sorted(VERBS))
    time = rng.choice(sorted(TIMES)) if rng.random() < 0.35 else None
    place = rng.choice(sorted(PLACES)) if rng.random() < 0.35 else None
    clause = rng.choice(sorted(CLAUSES)) if rng.random() < 0.25 else None
    english = [subject_en, verb, object_en] + ([f"in the {place}"] if place else [])
    if time:
        english = [time, *english]
    german_place = []
    if place:
        word, gender = PLACES[place]
        german_place = [f"in der {word}" if gender == "f" else f"im {word}"]
    rest = [object_de("acc"), *german_place]
    if clause:  # subordinate clause: the verb goes last; the adverb stays after the subject
        german = [subject_de("nom"), *([TIMES[time]] if time else []), *rest, VERBS[verb]]
        english, german = [clause, *english], [CLAUSES[clause], *german]
    elif time:  # verb second: the fronted adverb pushes the subject behind the verb
        german = [TIMES[time], VERBS[verb], subject_de("nom"), *rest]
    else:
        german = [subject_de("nom"), VERBS[verb], *rest]
    return " ".join(english) + ".", " ".join(german) + "."


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "translation")
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--validation", type=int, default=200)
    parser.add_argument("--test", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    wanted = args.train + args.validation + args.test
    pairs, seen = [], set()
    while len(pairs) < wanted:  # no English sentence twice, within or across splits
        english, german = sentence_pair(rng)
        if english not in seen:
            seen.add(english)
            pairs.append((english, german))
    args.out.mkdir(parents=True, exist_ok=True)
    splits = {"train": pairs[:args.train], "validation": pairs[args.train:args.train + args.validation],
              "test": pairs[args.train + args.validation:]}
    for split, rows in splits.items():
        with open(args.out / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            for english, german in rows:
                handle.write(json.dumps({"translation": {"en": english, "de": german}}) + "\n")
        print(f"{split}: {len(rows)} pairs -> {args.out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
