"""Generate the small, deterministic SQuAD-format question-answering sets shipped in data/qa/."""

import argparse
import json
import random
from pathlib import Path

FIRST = ["Amelia", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ines", "Jonas", "Katarina",
         "Lorenzo", "Maren", "Nikolai", "Odile", "Pavel", "Quentin", "Rosa", "Stefan", "Tamsin", "Ulrich", "Vera",
         "Wilhelm", "Xenia", "Yusuf", "Zofia", "Anton", "Beatrix", "Casimir", "Dagny", "Emil", "Flora", "Gustav",
         "Helga", "Ivo", "Julia", "Konrad", "Livia", "Matteo", "Nadia", "Oskar", "Petra", "Rafael", "Sabine",
         "Tobias", "Ursula", "Viktor", "Wanda", "Arvid", "Bianca", "Cyril", "Delia", "Edgar", "Frida"]
LAST = ["Albrecht", "Bergmann", "Castellano", "Dvorak", "Eriksen", "Fontaine", "Gallagher", "Halvorsen", "Ivanova",
        "Jablonski", "Kowalczyk", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrescu", "Quiroga", "Rasmussen",
        "Sandoval", "Takahashi", "Umberti", "Varga", "Whitlock", "Yilmaz", "Zeller", "Ashdown", "Brandt", "Corvino",
        "Delacroix", "Esposito", "Falk", "Grimaldi", "Horvath", "Iversen", "Kessler", "Larsen", "Marchetti"]
CITIES = ["Lisbon", "Krakow", "Ghent", "Tartu", "Bergen", "Porto", "Lyon", "Graz", "Turin", "Brno", "Leipzig",
          "Uppsala", "Aarhus", "Bilbao", "Salzburg", "Trieste", "Szeged", "Cluj", "Riga", "Vilnius", "Utrecht",
          "Bologna", "Seville", "Dresden", "Tampere", "Galway", "Plovdiv", "Ljubljana", "Zagreb", "Antwerp",
          "Basel", "Malmo", "Gdansk", "Coimbra", "Nantes", "Verona", "Innsbruck", "Bruges", "Odense", "Kaunas"]
PROFESSIONS = ["architect", "botanist", "cartographer", "chemist", "composer", "engineer", "geologist", "historian",
               "journalist", "linguist", "mathematician", "painter", "philosopher", "photographer", "physician",
               "poet", "sculptor", "astronomer", "economist", "novelist", "violinist", "surgeon", "zoologist"]
NATIONALITIES = ["Portuguese", "Polish", "Belgian", "Estonian", "Norwegian", "French", "Austrian", "Italian",
                 "Czech", "German", "Swedish", "Danish", "Spanish", "Hungarian", "Romanian", "Latvian", "Dutch"]
ORG_KINDS = ["Society", "Institute", "Academy", "Foundation", "Circle", "Workshop", "Laboratory", "Review"]
ORG_TOPICS = ["Applied Optics", "Coastal Studies", "Folk Music", "Modern Design", "Natural History",
              "Urban Planning", "Alpine Botany", "Early Printing", "Marine Charts", "Public Health",
              "Glass Arts", "River Engineering", "Comparative Grammar", "Mineral Sciences"]
PRIZES = ["Golden Compass", "Silver Lyre", "Northern Star Medal", "Harbour Prize", "Laurel of Merit",
          "Blue Quill Award", "Meridian Medal", "Crystal Lantern", "Oak Leaf Prize", "Amber Cross"]
WORKS = ["The Quiet Harbour", "Letters from the North", "A Grammar of Stones", "The Salt Road",
         "Notes on Winter Light", "The Lantern Keepers", "Atlas of Small Rivers", "The Glass Orchard",
         "Songs for an Empty House", "The Clockmaker's Daughter", "Maps of the Interior", "A Study in Tides"]
INSTRUMENTS = ["a microscope", "a telescope", "a printing press", "a sailing boat", "a workshop", "a library",
               "an observatory", "a greenhouse"]
# Background sentences: long contexts (so features overflow max_seq_length 128/192 and doc_stride matters)
# that also mention cities and years which are not the answer.
FILLER = [
    "The city of {c} was then known for its markets, its river port and its crowded university quarter.",
    "Contemporary accounts describe long winters, expensive paper and a lively culture of public lectures.",
    "Records from {y} mention a fire in {c} that destroyed several archives and delayed many projects.",
    "Friends later recalled long walks along the water and conversations that lasted well into the night.",
    "Much of the correspondence from these years was lost, although a few notebooks survive in {c}.",
    "Historians have debated the period at length, and several biographies give conflicting dates.",
    "A railway line reaching {c} in {y} made travel between the major cities far easier than before.",
    "The family owned {i}, which visitors often mentioned in their letters.",
    "Critics of the time were divided, and reviews in the regional press ranged from warm to hostile.",
    "An exhibition held in {c} in {y} brought renewed public attention to the whole generation.",
]


def person(rng):
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


class Paragraph:
    """A context built sentence by sentence, recording the character span of every fact it states."""

    def __init__(self):
        self.text = ""
        self.facts = {}

    def add(self, template, **values):
        """Append `template`; values whose key starts with an uppercase letter are recorded as answer spans."""
        sentence_start = len(self.text) + (1 if self.text else 0)
        self.text += (" " if self.text else "")
        rendered, cursor = "", 0
        while cursor < len(template):
            open_ = template.find("{", cursor)
            if open_ < 0:
                rendered += template[cursor:]
                break
            close = template.index("}", open_)
            rendered += template[cursor:open_]
            key = template[open_ + 1:close]
            if key[0].isupper():
                self.facts[key] = (str(values[key]), sentence_start + len(rendered))
            rendered += str(values[key])
            cursor = close + 1
        self.text += rendered


def biography(rng, name, index):
    """One encyclopedia-style paragraph about `name` and the questions it can answer (and, for v2, cannot)."""
    he = rng.choice(["he", "she"])
    his = "his" if he == "he" else "her"
    cities = rng.sample(CITIES, 6)
    born = rng.randint(1780, 1900)
    years = sorted(rng.sample(range(born + 18, born + 70), 4))
    died = years[-1] + rng.randint(1, 12)
    spouse = person(rng)
    teacher = person(rng)
    org = f"{rng.choice(ORG_TOPICS)} {rng.choice(ORG_KINDS)}"
    work = rng.choice(WORKS)
    facts = dict(Profession=rng.choice(PROFESSIONS), Birthplace=cities[0], Birthyear=born, Studycity=cities[1],
                 Teacher=teacher, Movecity=cities[2], Moveyear=years[0], Spouse=spouse, Marriageyear=years[1],
                 Org=org, Foundyear=years[2], Prize=rng.choice(PRIZES), Prizeyear=years[3], Work=work,
                 Deathplace=cities[3], Deathyear=died)
    nationality = rng.choice(NATIONALITIES)
    filler = lambda: rng.choice(FILLER).format(c=rng.choice(cities[4:]), y=rng.randint(born, died),  # noqa: E731
                                                i=rng.choice(INSTRUMENTS))
    optional = {"Spouse": rng.random() < 0.8, "Prize": rng.random() < 0.8, "Org": rng.random() < 0.8}
    p = Paragraph()
    p.add("{name} ({Birthyear}–{Deathyear}) was a {nationality} {Profession}.", name=name, nationality=nationality,
          **facts)
    p.add("Born in {Birthplace}, {he} grew up in a family of modest means.", he=he, **facts)
    p.add(filler())
    p.add("{name} later studied in {Studycity} under the guidance of {Teacher}.", name=name.split()[0], **facts)
    p.add(filler())
    p.add("In {Moveyear}, {name} moved to {Movecity}, where the most productive years began.",
          name=name.split()[1], **facts)
    p.add(filler())
    if optional["Spouse"]:
        p.add("{He} married {Spouse} in {Marriageyear}.", He=he.capitalize(), **facts)
    if optional["Org"]:
        p.add("Together with several colleagues, {name} founded the {Org} in {Foundyear}.",
              name=name.split()[1], **facts)
    p.add(filler())
    p.add("{His} best known work, {Work}, is still read and discussed today.", His=his.capitalize(), **facts)
    if optional["Prize"]:
        p.add("For this work {he} received the {Prize} in {Prizeyear}.", he=he, **facts)
    p.add(filler())
    p.add("{name} died in {Deathplace} in {Deathyear}.", name=name, **facts)
    p.add(filler())

    first, last = name.split()
    asks = {
        "Profession": [f"What was {name}'s profession?", f"What did {name} work as?"],
        "Birthplace": [f"Where was {name} born?", f"In which city was {last} born?"],
        "Birthyear": [f"In what year was {name} born?", f"When was {first} {last} born?"],
        "Studycity": [f"Where did {name} study?", f"In which city did {last} study?"],
        "Teacher": [f"Who taught {name}?", f"Under whose guidance did {last} study?"],
        "Movecity": [f"Where did {name} move to?", f"To which city did {last} move?"],
        "Moveyear": [f"When did {name} move to {cities[2]}?", f"In what year did {last} move?"],
        "Spouse": [f"Who did {name} marry?", f"Who was {last}'s spouse?"],
        "Marriageyear": [f"When did {name} marry?", f"In what year did {last} marry {spouse}?"],
        "Org": [f"What did {name} found?", f"Which organisation did {last} found?"],
        "Foundyear": [f"When was the {org} founded?", f"In what year did {last} found the {org}?"],
        "Prize": [f"Which prize did {name} receive?", f"What award did {last} win?"],
        "Prizeyear": [f"When did {name} receive the {facts['Prize']}?"],
        "Work": [f"What is {name}'s best known work?", f"Which work is {last} best known for?"],
        "Deathplace": [f"Where did {name} die?", f"In which city did {last} die?"],
        "Deathyear": [f"When did {name} die?", f"In what year did {first} {last} die?"],
    }
    dependent = {"Marriageyear": "Spouse", "Foundyear": "Org", "Prizeyear": "Prize"}
    answerable, unanswerable = [], []
    for key, questions in asks.items():
        stated = key in p.facts and optional.get(dependent.get(key, key), True)
        question = rng.choice(questions)
        if stated:
            text, start = p.facts[key]
            assert p.text[start:start + len(text)] == text
            answerable.append((question, {"text": text, "answer_start": start}))
        else:  # asked about a fact the paragraph does not state: no answer (SQuAD v2)
            unanswerable.append(question)
    # Another person the paragraph never mentions: no answer either.
    stranger = person(rng)
    while stranger.split()[1] == last:
        stranger = person(rng)
    unanswerable.append(rng.choice(list(asks.values()))[0].replace(name, stranger))

    def qa(n, question, answer=None):
        return {"id": f"{index:04d}-{n:02d}", "question": question, "is_impossible": answer is None,
                "answers": [answer] if answer else []}

    picked = rng.sample(answerable, min(5, len(answerable)))
    v1 = [qa(n, q, a) for n, (q, a) in enumerate(picked)]
    v2_extra = [qa(len(v1) + n, q) for n, q in enumerate(rng.sample(unanswerable, min(2, len(unanswerable))))]
    return {"title": name, "paragraphs": [{"context": p.text, "qas": v1}]}, v2_extra


def build(rng, names, offset):
    v1, v2 = [], []
    for index, name in enumerate(names, start=offset):
        article, extra = biography(rng, name, index)
        v1.append(article)
        v2.append({"title": article["title"], "paragraphs": [{"context": article["paragraphs"][0]["context"],
                                                             "qas": article["paragraphs"][0]["qas"] + extra}]})
    return v1, v2


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output_dir", default=str(Path(__file__).resolve().parent.parent / "data" / "qa"))
    parser.add_argument("--train_articles", type=int, default=80)
    parser.add_argument("--validation_articles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pool = sorted({f"{f} {l}" for f in FIRST for l in LAST})
    names = rng.sample(pool, args.train_articles + args.validation_articles)
    train = build(rng, names[:args.train_articles], 0)
    validation = build(rng, names[args.train_articles:], args.train_articles)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stem, (v1, v2) in {"train": train, "validation": validation}.items():
        for suffix, data in {"": v1, "_v2": v2}.items():
            path = out / f"{stem}{suffix}.json"
            path.write_text(json.dumps({"version": "v2.0" if suffix else "1.1", "data": data}, indent=1) + "\n")
            questions = sum(len(p["qas"]) for a in data for p in a["paragraphs"])
            print(f"{path}: {len(data)} articles, {questions} questions")


if __name__ == "__main__":
    main()
