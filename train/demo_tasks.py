"""Small generated tasks for the demo: each a different skill whose answers can be checked exactly;
labelled tasks (`LABELLED_TASKS`) for classification adapters with task heads."""

from __future__ import annotations

import json
import os
import random

WORDS = (
    "apple river cloud stone tiger piano garden rocket silver candle forest bottle window dragon "
    "pepper castle mirror rabbit planet yellow hammer jacket orange pencil guitar island lemon "
    "marble violet wizard basket cookie desert falcon helmet kettle ladder magnet needle parrot "
    "quartz saddle tunnel wallet zipper anchor bridge copper dolphin engine feather glacier harbor"
).split()


def _words(rng: random.Random, low: int, high: int) -> list[str]:
    return rng.sample(WORDS, rng.randint(low, high))


def last_word(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 3, 6)
    return f"Words: {' '.join(words)}\nLast word:", f" {words[-1]}"


def first_word(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 3, 6)
    return f"Words: {' '.join(words)}\nFirst word:", f" {words[0]}"


def repeat_twice(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Word: {word}\nSay it twice:", f" {word} {word}"


def count_words(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 2, 5)
    return f"Words: {' '.join(words)}\nHow many words:", f" {len(words)}"


def second_word(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 3, 6)
    return f"Words: {' '.join(words)}\nSecond word:", f" {words[1]}"


def first_and_last(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 3, 6)
    return f"Words: {' '.join(words)}\nFirst and last:", f" {words[0]} {words[-1]}"


def reverse_pair(rng: random.Random) -> tuple[str, str]:
    first, second = _words(rng, 2, 2)
    return f"Words: {first} {second}\nReversed:", f" {second} {first}"


def repeat_thrice(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Word: {word}\nSay it three times:", f" {word} {word} {word}"


def uppercase(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Word: {word}\nIn capitals:", f" {word.upper()}"


def first_letter(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Word: {word}\nFirst letter:", f" {word[0]}"


def last_letter(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Word: {word}\nLast letter:", f" {word[-1]}"


def word_length(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Word: {word}\nLetters:", f" {len(word)}"


def next_number(rng: random.Random) -> tuple[str, str]:
    number = rng.randint(1, 98)
    return f"Number: {number}\nNext:", f" {number + 1}"


def previous_number(rng: random.Random) -> tuple[str, str]:
    number = rng.randint(2, 99)
    return f"Number: {number}\nPrevious:", f" {number - 1}"


def add_numbers(rng: random.Random) -> tuple[str, str]:
    x, y = rng.randint(1, 9), rng.randint(1, 9)
    return f"Add: {x} and {y}\nSum:", f" {x + y}"


def double_number(rng: random.Random) -> tuple[str, str]:
    number = rng.randint(1, 49)
    return f"Number: {number}\nDouble:", f" {2 * number}"


TASKS = {"last_word": last_word, "first_word": first_word, "repeat_twice": repeat_twice, "count_words": count_words,
         "second_word": second_word, "first_and_last": first_and_last, "reverse_pair": reverse_pair,
         "repeat_thrice": repeat_thrice, "uppercase": uppercase, "first_letter": first_letter,
         "last_letter": last_letter, "word_length": word_length, "next_number": next_number,
         "previous_number": previous_number, "add_numbers": add_numbers, "double_number": double_number}
DEMO_TASKS = ("last_word", "repeat_twice", "first_word")


def make_examples(task: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(f"{task}-{seed}")
    return [dict(zip(("prompt", "completion"), TASKS[task](rng))) for _ in range(count)]


def write_jsonl(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def is_correct(completion: str, answer: str) -> bool:
    """Exact match of the first line of the model's completion, ignoring surrounding spaces."""
    return completion.strip().split("\n")[0].strip() == answer.strip()


# ---- labelled tasks (task heads: `{"text", "label"}` records, `train.heads`) ----

TOPICS = {
    "animal": "tiger rabbit dolphin falcon parrot horse",
    "food": "apple lemon cookie pepper bread cheese",
    "music": "piano guitar violin drum flute trumpet",
    "travel": "rocket island bridge harbor train airport",
}
ADJECTIVES = "small old bright strange famous quiet red lovely heavy new".split()
TEMPLATES = ("Yesterday I saw a {adj} {word} by the road.", "My friend talked about the {adj} {word} all day.",
             "There is a picture of a {adj} {word} on the wall.", "We read a story about a {adj} {word}.",
             "The {adj} {word} was all anyone could think of.", "Everyone in town loved the {adj} {word}.")


NEW_TEMPLATES = ("She painted the {adj} {word} last summer.", "Nobody expected to find a {adj} {word} there.",
                 "The {word} looked {adj} in the morning light.", "Tell me something about the {adj} {word}.")


def topic(rng: random.Random, templates=TEMPLATES) -> tuple[str, str]:
    """A sentence about one word of a topic's small vocabulary; the label is the topic."""
    label = rng.choice(sorted(TOPICS))
    word = rng.choice(TOPICS[label].split())
    return rng.choice(templates).format(adj=rng.choice(ADJECTIVES), word=word), label


def topic_new_sentences(rng: random.Random) -> tuple[str, str]:
    """`topic` in sentences none of `TEMPLATES` makes (held-out data for a head trained on `topic`)."""
    return topic(rng, NEW_TEMPLATES)


TOPIC_LABELS = tuple(sorted(TOPICS))
LABELLED_TASKS = {"topic": (TOPIC_LABELS, topic), "topic_new_sentences": (TOPIC_LABELS, topic_new_sentences)}


def make_labelled_examples(task: str, count: int, seed: int, exclude=()) -> list[dict]:
    """`count` distinct {"text", "label"} records of a labelled task, none of whose texts is in
    `exclude` (held-out data: pass the training texts)."""
    rng, seen, records = random.Random(f"{task}-{seed}"), set(exclude), []
    generate = LABELLED_TASKS[task][1]
    for _ in range(100 * count):
        text, label = generate(rng)
        if text not in seen:
            seen.add(text)
            records.append({"text": text, "label": label})
            if len(records) == count:
                return records
    raise ValueError(f"task {task!r} has fewer than {count} distinct texts outside `exclude`")
