"""The course's own text: a small, deterministic story world, and an instruction task drawn from it.

A template grammar over a few hundred words writes short stories in which the same hero, animal and
colors come back, so the default model learns to copy a word from its context. The task's questions
("Which animal is in this sentence?") have a one-word answer found in the input; the corpus never holds
a question, so the base model does not know the format and a short LoRA run teaches it.

    python -m amdllm.course.corpus [--out data/]     # rewrite data/ (tests check it reproduces the files)"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from amdllm.files import atomic_write_text

TRAIN_STORIES, HELDOUT_STORIES = 4000, 150
TASK_TRAIN_ROWS, TASK_HELDOUT_ROWS = 3000, 200
SEEDS = {"train": 1, "heldout": 2, "task_train": 3, "task_heldout": 4}
FILES = ("corpus_train.txt", "corpus_heldout.txt", "task_train.jsonl", "task_heldout.jsonl")

NAMES = ("Tom", "Anna", "Ben", "Lily", "Max", "Mia", "Sam", "Zoe", "Leo", "Emma", "Jack", "Lucy", "Noah",
         "Ella", "Finn", "Rosa", "Hugo", "Nora", "Omar", "Ivy", "Paul", "Kate", "Dan", "Eva", "Luke", "Ruby",
         "Alex", "Maya", "Oscar", "Sofia")
# animal -> (plural, sound, home, what it can do)
ANIMALS = {
    "fox": ("foxes", "yip", "forest", "run fast"), "cat": ("cats", "meow", "house", "climb trees"),
    "dog": ("dogs", "woof", "house", "dig holes"), "bird": ("birds", "tweet", "tree", "fly"),
    "frog": ("frogs", "croak", "pond", "jump far"), "rabbit": ("rabbits", "squeak", "meadow", "hop"),
    "bear": ("bears", "growl", "cave", "climb trees"), "mouse": ("mice", "squeak", "barn", "hide"),
    "duck": ("ducks", "quack", "pond", "swim"), "horse": ("horses", "neigh", "farm", "run fast"),
    "cow": ("cows", "moo", "farm", "eat grass"), "pig": ("pigs", "oink", "farm", "roll in mud"),
    "sheep": ("sheep", "baa", "field", "eat grass"), "goat": ("goats", "bleat", "hill", "climb rocks"),
    "owl": ("owls", "hoot", "tree", "see at night"), "deer": ("deer", "bleat", "forest", "jump high"),
    "wolf": ("wolves", "howl", "forest", "run fast"), "lion": ("lions", "roar", "grassland", "run fast"),
    "turtle": ("turtles", "hiss", "lake", "swim"), "bee": ("bees", "buzz", "garden", "make honey"),
    "hen": ("hens", "cluck", "farm", "lay eggs"), "squirrel": ("squirrels", "chatter", "park", "climb trees"),
    "otter": ("otters", "squeak", "river", "swim"), "goose": ("geese", "honk", "lake", "fly"),
}
COLORS = ("red", "blue", "green", "yellow", "brown", "black", "white", "gray", "orange", "pink", "purple",
          "gold")
PLACES = ("forest", "river", "garden", "farm", "hill", "lake", "park", "village", "beach", "field", "cave",
          "meadow", "pond", "town", "market", "school", "bridge", "mountain", "barn", "island")
FOODS = ("apples", "carrots", "bread", "cheese", "berries", "fish", "honey", "seeds", "corn", "nuts", "cake",
         "soup", "grapes", "pears", "plums", "eggs")
THINGS = {"ball": "balls", "kite": "kites", "hat": "hats", "box": "boxes", "book": "books", "boat": "boats",
          "drum": "drums", "cup": "cups", "bag": "bags", "key": "keys", "lamp": "lamps", "map": "maps",
          "shell": "shells", "stone": "stones", "flower": "flowers", "bell": "bells"}
NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
ADJECTIVES = ("big", "small", "little", "happy", "sleepy", "brave", "kind", "quick", "quiet", "old", "young",
              "clever", "shy", "funny", "gentle", "busy")
WEATHER = ("sunny", "rainy", "windy", "cold", "warm", "snowy", "bright", "foggy")
GAMES = ("played tag", "sang songs", "danced in the grass", "built a little house", "looked at the clouds",
         "told funny stories", "ran up the hill", "counted the stars", "drew pictures", "picked flowers")
FEELINGS = ("happy", "tired", "glad", "proud", "sleepy", "calm")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _pick(rng: random.Random, seq, *exclude):
    """A random element of `seq` different from everything in `exclude` (distractors stay distinct)."""
    return rng.choice([x for x in seq if x not in exclude])


def story(rng: random.Random) -> str:
    """One short story on one line: a hero (name, animal, color) meets a friend somewhere and plays."""
    animals = list(ANIMALS)
    name, animal, color, adj = rng.choice(NAMES), rng.choice(animals), rng.choice(COLORS), rng.choice(ADJECTIVES)
    name2 = _pick(rng, NAMES, name)
    animal2, color2 = _pick(rng, animals, animal), _pick(rng, COLORS, color)
    home, place = ANIMALS[animal][2], _pick(rng, PLACES, ANIMALS[animal][2])
    food, thing, number = rng.choice(FOODS), rng.choice(list(THINGS)), rng.choice(NUMBERS)
    s = [f"Once upon a time, there was {_a(adj)} {color} {animal} named {name}."]
    s.append(rng.choice([f"{name} lived in the {home}.", f"{name} lived near the {home} with {number} "
                         f"{ANIMALS[animal][0]}."]))
    s.append(rng.choice([f"Every day, {name} liked to eat {food}.", f"{name} had {number} {THINGS[thing]}.",
                         f"{name} could {ANIMALS[animal][3]}."]))
    s.append(f"One {rng.choice(WEATHER)} morning, {name} went to the {place}.")
    s.append(f"There, {name} met {_a(color2)} {animal2} named {name2}.")
    s.append(rng.choice([f"The {animal2} said {ANIMALS[animal2][1]}.", f"{name2} was {rng.choice(ADJECTIVES)}.",
                         f"{name2} said, \"Hello, {name}! Let us play.\""]))
    s.append(f"{name} and {name2} {rng.choice(GAMES)}.")
    words = {"animal": (f"{name} pointed at the {animal2} and said", animal2),
             "color": (f"{name2} looked at the {color} {animal} and said", color),
             "place": (f"{name} looked at the {place} and said", place),
             "number": (f"{name2} counted {number} stars and said", number),
             "name": (f"{name2} called out to {name} and said", name),
             "food": (f"{name} found some {food} and said", food)}
    for kind in rng.sample(sorted(words), 2):  # a quoted word is written without its leading space
        s.append(f"{words[kind][0]} \"{words[kind][1]}\".")
    if rng.random() < 0.5:
        s.append(f"They ate {rng.choice(FOODS)} together.")
    s.append(f"When the sun went down, the {color} {animal} went home to the {home}.")
    s.append(f"{name} was very {rng.choice(FEELINGS)}. The end.")
    return " ".join(s)


def facts(rng: random.Random) -> str:
    """A line of world facts; the same animal always has the same sound, home and skill."""
    out = []
    for animal in rng.sample(list(ANIMALS), 3):
        plural, sound, home, can = ANIMALS[animal]
        out.append(rng.choice([f"The {animal} says {sound}.", f"{plural.capitalize()} live in the {home}.",
                               f"{_a(animal).capitalize()} can {can}.",
                               f"The {rng.choice(COLORS)} {animal} is {rng.choice(ADJECTIVES)}."]))
    return " ".join(out)


def corpus(n_stories: int, seed: int) -> str:
    """`n_stories` lines, about one in eight a line of facts instead of a story."""
    rng = random.Random(seed)
    return "".join((facts(rng) if rng.random() < 0.125 else story(rng)) + "\n" for _ in range(n_stories))


# --------------------------------------------------------------------------------------------------
# The instruction task: every answer is one word of the input, the only word of its kind there (one
# color, one place, one number...); the other words are distractors of other kinds. A first version
# put two entities of the answer's kind in each input ("The red fox met the blue owl." / "What color is
# the owl?"): that needs the model to bind the color to its animal, which a model this small with a
# rank-8 adapter did not learn in minutes of training.
# --------------------------------------------------------------------------------------------------
def _task_animal(rng):
    animal, color, place = rng.choice(list(ANIMALS)), rng.choice(COLORS), rng.choice(PLACES)
    sentence = rng.choice([f"The {color} {animal} went to the {place}.",
                           f"{rng.choice(NAMES)} met {_a(color)} {animal} near the {place}.",
                           f"There was {_a(rng.choice(ADJECTIVES))} {animal} in the {place}."])
    return "Which animal is in this sentence?", sentence, animal


def _task_color(rng):
    a1, a2 = rng.sample(list(ANIMALS), 2)
    color, place = rng.choice(COLORS), rng.choice(PLACES)
    text = rng.choice([f"{_a(color).capitalize()} {a1} and {_a(a2)} played in the {place}.",
                       f"The {color} {a1} met {_a(rng.choice(ADJECTIVES))} {a2} at the {place}.",
                       f"{rng.choice(NAMES)} saw {_a(color)} {a1} near the {place}."])
    return f"What color is the {a1}?", text, color


def _task_place(rng):
    n1, n2 = rng.sample(NAMES, 2)
    place = rng.choice(PLACES)
    text = rng.choice([f"{n1} went to the {place} with {n2}.", f"{n1} went to the {place}. {n2} stayed home.",
                       f"One day, {n1} went to the {place} with {_a(rng.choice(list(ANIMALS)))}."])
    return f"Where did {n1} go?", text, place


def _task_count(rng):
    n1, n2 = rng.sample(NAMES, 2)
    number, thing = rng.choice(NUMBERS), rng.choice(list(THINGS))
    text = rng.choice([f"{n1} had {number} {THINGS[thing]}.",
                       f"{n1} had {number} {THINGS[thing]} and {n2} had {_a(_pick(rng, list(THINGS), thing))}.",
                       f"{n1} had {number} {THINGS[thing]} in the {rng.choice(PLACES)}."])
    return f"How many {THINGS[thing]} did {n1} have?", text, number


def _task_name(rng):
    a1, a2 = rng.sample(list(ANIMALS), 2)
    name = rng.choice(NAMES)
    text = rng.choice([f"There was {_a(a1)} named {name}.", f"There was {_a(a1)} named {name} and {_a(a2)} with no name.",
                       f"{_a(rng.choice(COLORS)).capitalize()} {a1} named {name} lived in the {rng.choice(PLACES)}."])
    return f"What is the name of the {a1}?", text, name


def _task_food(rng):
    n1, n2 = rng.sample(NAMES, 2)
    food = rng.choice(FOODS)
    text = rng.choice([f"{n1} liked to eat {food}.", f"{n1} liked to eat {food} with {n2}.",
                       f"{n1} and {_a(rng.choice(list(ANIMALS)))} liked to eat {food} in the {rng.choice(PLACES)}."])
    return f"What did {n1} like to eat?", text, food


TASK_KINDS = (_task_animal, _task_color, _task_place, _task_count, _task_name, _task_food)


# The first words of each kind's instruction, in TASK_KINDS order.
TASK_KIND_NAMES = {"Which animal": "animal", "What color": "color", "Where did": "place", "How many": "number",
                   "What is": "name", "What did": "food"}


def task_kind(row: dict) -> str:
    """The kind of a course task row ("animal", "color", ...), from its instruction's first two words."""
    return TASK_KIND_NAMES.get(" ".join(row["instruction"].split()[:2]), "other")


# In the stories, a quoted word copies a word from earlier in the sentence; per kind, the regex of the
# text before the quote, with the word to copy as group 1 (see `story`).
QUOTES = {"animal": r'pointed at the (\w+) and said "', "color": r'looked at the (\w+) \w+ and said "',
          "place": r'looked at the (\w+) and said "', "number": r'counted (\w+) stars and said "',
          "name": r'called out to (\w+) and said "', "food": r'found some (\w+) and said "'}


def quote_prompts(text: str, per_kind: int = 24) -> dict[str, list[tuple[str, str]]]:
    """For each kind, up to `per_kind` (story prefix ending at an opening quote, the word to copy) from `text`."""

    out = {kind: [] for kind in QUOTES}
    for line in text.splitlines():
        for kind, pattern in QUOTES.items():
            m = re.search(pattern, line)
            if m and len(out[kind]) < per_kind:
                out[kind].append((line[:m.end()], m.group(1)))
    return out


def task_rows(n: int, seed: int, exclude: set | None = None) -> list[dict]:
    """`n` distinct Alpaca rows {"instruction", "input", "output"}, kinds in turn; none in `exclude`."""
    rng, rows, seen = random.Random(seed), [], set(exclude or ())
    while len(rows) < n:
        instruction, text, answer = TASK_KINDS[len(rows) % len(TASK_KINDS)](rng)
        if (instruction, text) in seen:
            continue
        seen.add((instruction, text))
        rows.append({"instruction": instruction, "input": text, "output": answer})
    return rows


def sum_rows(n: int, seed: int, exclude: set | None = None) -> list[dict]:
    """`n` distinct Alpaca rows asking for the sum of two 2-digit numbers. The answer is no word of the
    input, so a model must compute it: the course task's copying saturates a pretrained model."""
    rng, rows, seen = random.Random(seed), [], set(exclude or ())
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if f"{a} + {b}" in seen:
            continue
        seen.add(f"{a} + {b}")
        rows.append({"instruction": "Add the two numbers. Answer with the sum only.", "input": f"{a} + {b}",
                     "output": str(a + b)})
    return rows


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def generate_all() -> dict[str, str]:
    """File name -> exact contents of every generated file in data/."""
    train_rows = task_rows(TASK_TRAIN_ROWS, SEEDS["task_train"])
    seen = {(r["instruction"], r["input"]) for r in train_rows}
    return {
        "corpus_train.txt": corpus(TRAIN_STORIES, SEEDS["train"]),
        "corpus_heldout.txt": corpus(HELDOUT_STORIES, SEEDS["heldout"]),
        "task_train.jsonl": jsonl(train_rows),
        "task_heldout.jsonl": jsonl(task_rows(TASK_HELDOUT_ROWS, SEEDS["task_heldout"], exclude=seen)),
    }


def write_all(out: str | Path) -> list[Path]:
    out = Path(out)
    paths = []
    for name, text in generate_all().items():
        atomic_write_text(out / name, text)
        paths.append(out / name)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m amdllm.course.corpus", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "data"))
    args = p.parse_args(argv)
    for path in write_all(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
