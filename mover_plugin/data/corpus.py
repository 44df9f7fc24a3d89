"""The synthetic English-like text corpus that the example pretraining script trains on.

The corpus is generated, not collected: a seeded generator writes a few hundred short documents
about a small world of people, objects, colours and places, simple arithmetic facts, counting
sequences and small stories about owning and giving things. The text is highly regular, so a
tiny byte-level GPT learns its spelling and templates within a few dozen optimizer steps and its
loss drops visibly from the start.

The repository ships the output of the default arguments as ``mover_plugin/data/corpus/
corpus.jsonl`` (one JSON object ``{"text": ...}`` per line). Regenerate it with::

    python -m mover_plugin.data.corpus --output mover_plugin/data/corpus/corpus.jsonl

Only :meth:`random.Random.random` is drawn from, because Python guarantees that method's
sequence for a given seed across versions; every other choice is derived from it here, so the
same arguments produce the same bytes on every supported Python.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

DEFAULT_NUM_DOCUMENTS = 300
"""How many documents the shipped corpus holds."""

DEFAULT_SEED = 1234
"""The seed the shipped corpus was generated with."""

JSON_KEY = "text"
"""The key of each JSON line that holds the document text."""

_T = TypeVar("_T")

_NAMES = ("Ana", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena")
_COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
_OBJECTS = ("box", "ball", "cup", "book", "lamp", "key", "hat", "shoe", "coin", "pen", "bag")
_PLACES = ("table", "chair", "bed", "shelf", "desk", "door", "window", "rug", "sofa")
_RELATIONS = ("on", "under", "next to", "behind", "in front of", "near")
_FRUITS = (
    ("apple", "apples"), ("pear", "pears"), ("plum", "plums"), ("fig", "figs"),
    ("lemon", "lemons"), ("orange", "oranges"), ("grape", "grapes"), ("cherry", "cherries"),
)  # fmt: skip
_NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
)  # fmt: skip


class _Draw:
    """Integer and choice draws built only on ``random.Random.random``."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        """Return an integer in ``[low, high]``, both ends included."""
        return low + int(self._rng.random() * (high - low + 1))

    def choice(self, options: Sequence[_T]) -> _T:
        """Return one element of ``options``."""
        return options[self.integer(0, len(options) - 1)]


def _world_document(draw: _Draw) -> str:
    """Describe where a few coloured objects are, then ask and answer about each of them."""
    things = []
    for _ in range(draw.integer(3, 6)):
        thing = f"{draw.choice(_COLOURS)} {draw.choice(_OBJECTS)}"
        where = f"{draw.choice(_RELATIONS)} the {draw.choice(_PLACES)}"
        things.append((thing, where))
    lines = [f"The {thing} is {where}." for thing, where in things]
    for thing, where in things:
        lines.append(f"Where is the {thing}? The {thing} is {where}.")
    return " ".join(lines)


def _arithmetic_document(draw: _Draw) -> str:
    """State a handful of true sums, differences and products."""
    facts = []
    for _ in range(draw.integer(8, 16)):
        a, b = draw.integer(0, 20), draw.integer(0, 20)
        kind = draw.integer(0, 2)
        if kind == 0:
            facts.append(f"{a} plus {b} is {a + b}.")
        elif kind == 1:
            big, small = max(a, b), min(a, b)
            facts.append(f"{big} minus {small} is {big - small}.")
        else:
            a, b = a % 11, b % 11
            facts.append(f"{a} times {b} is {a * b}.")
    return " ".join(facts)


def _counting_document(draw: _Draw) -> str:
    """Count up in a fixed step, in digits, and count in words."""
    start, step = draw.integer(0, 50), draw.integer(1, 5)
    count = draw.integer(10, 20)
    numbers = [str(start + step * i) for i in range(count)]
    lines = [f"Counting from {numbers[0]} by {step}: {', '.join(numbers)}."]
    first = draw.integer(0, 10)
    words = _NUMBER_WORDS[first : first + draw.integer(5, 10)]
    lines.append(f"In words: {', '.join(words)}.")
    down = [str(n) for n in range(draw.integer(5, 12), -1, -1)]
    lines.append(f"Counting down: {', '.join(down)}.")
    return " ".join(lines)


def _story_document(draw: _Draw) -> str:
    """Tell a short story of people giving each other fruit, keeping the counts right."""
    first, second = draw.choice(_NAMES), draw.choice(_NAMES)
    while second == first:
        second = draw.choice(_NAMES)
    singular, plural = draw.choice(_FRUITS)

    def fruit(amount: int) -> str:
        return f"{amount} {singular if amount == 1 else plural}"

    held = {first: draw.integer(1, 9), second: draw.integer(1, 9)}
    lines = [f"{name} has {fruit(held[name])}." for name in (first, second)]
    for _ in range(draw.integer(2, 5)):
        giver, taker = (first, second) if draw.integer(0, 1) == 0 else (second, first)
        if held[giver] == 0:
            giver, taker = taker, giver
        amount = draw.integer(1, held[giver])
        held[giver] -= amount
        held[taker] += amount
        lines.append(f"{giver} gives {taker} {fruit(amount)}.")
        lines.append(f"Now {giver} has {held[giver]} and {taker} has {held[taker]}.")
    total = held[first] + held[second]
    lines.append(f"Together they have {fruit(total)}.")
    return " ".join(lines)


_DOCUMENT_KINDS: tuple[Callable[[_Draw], str], ...] = (
    _world_document,
    _arithmetic_document,
    _counting_document,
    _story_document,
)


def _document(draw: _Draw) -> str:
    """Return one document of two to four paragraphs of randomly chosen kinds."""
    paragraphs = [draw.choice(_DOCUMENT_KINDS)(draw) for _ in range(draw.integer(2, 4))]
    return "\n".join(paragraphs)


def generate_documents(
    num_documents: int = DEFAULT_NUM_DOCUMENTS, seed: int = DEFAULT_SEED
) -> list[str]:
    """Return ``num_documents`` document texts, the same ones for the same arguments."""
    if num_documents < 1:
        raise ValueError(f"num_documents must be at least 1, got {num_documents}")
    draw = _Draw(seed)
    return [_document(draw) for _ in range(num_documents)]


def corpus_jsonl(documents: Sequence[str]) -> str:
    """Return the JSON-lines text of ``documents``: one ``{"text": ...}`` object a line."""
    return "".join(json.dumps({JSON_KEY: text}) + "\n" for text in documents)


def write_corpus(
    output: str | os.PathLike[str],
    num_documents: int = DEFAULT_NUM_DOCUMENTS,
    seed: int = DEFAULT_SEED,
) -> str:
    """Generate the corpus and write it to ``output`` atomically; return the path written."""
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = corpus_jsonl(generate_documents(num_documents, seed)).encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as stream:
            stream.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("wrote %d documents (%d bytes) to %s", num_documents, len(data), path)
    return str(path)


def default_corpus_path() -> str:
    """Return the path of the corpus file shipped inside the package."""
    return str(Path(__file__).resolve().parent / "corpus" / "corpus.jsonl")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mover_plugin.data.corpus",
        description="Generate the synthetic JSON-lines text corpus.",
    )
    parser.add_argument("--output", required=True, help="path of the .jsonl file to write")
    parser.add_argument(
        "--documents",
        type=int,
        default=DEFAULT_NUM_DOCUMENTS,
        help=f"number of documents (default {DEFAULT_NUM_DOCUMENTS})",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"generator seed (default {DEFAULT_SEED})"
    )
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error(f"--documents must be at least 1, got {args.documents}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    args = _parse_args(argv)
    path = write_corpus(args.output, args.documents, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
