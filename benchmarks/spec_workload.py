"""The repetitive workload of the speculative decoding benchmark: instructions that make the
model copy a given text (benchmarks/data/spec_source.txt) from its prompt, as editing,
rewriting and quoting tasks do; n-gram prompt lookup then finds most of each answer."""

from __future__ import annotations

from pathlib import Path

SOURCE = (Path(__file__).parent / "data" / "spec_source.txt").read_text().strip()

TASKS = (
    "Repeat the following text exactly, word for word.",
    "Copy the following text, replacing the name Varren with Ostmouth everywhere.",
    "Rewrite the following text with every sentence on its own line.",
    "Copy the following text and put the word 'Note:' before each sentence about the harbour.",
    "Quote the following text in full, then say in one line what it is about.",
    "Correct any mistakes in the following text and return the whole corrected text.",
    "Return the following text unchanged, but in the past tense.",
    "Repeat the following text, replacing 'boats' with 'ships'.",
)


def repetitive_chats() -> list[list[dict[str, str]]]:
    """One chat per task, each carrying the whole source text."""
    return [[{"role": "user", "content": f"{task}\n\n{SOURCE}"}] for task in TASKS]
