"""Word error rate for tests: lower-case, drop punctuation, spell digits as they were read."""

from __future__ import annotations

import re

from asrserve.benchmark.wer import word_errors as edit_distance

_NUMBERS = {str(i): w for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}


def normalize(text: str) -> list[str]:
    text = re.sub(r"[^\w\s']", " ", text.lower()).replace("'", "")
    return [_NUMBERS.get(word, word) for word in text.split()]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    ref = normalize(reference)
    return edit_distance(ref, normalize(hypothesis)), len(ref)


def corpus_wer(references: list[str], hypotheses: list[str]) -> float:
    errors = words = 0
    for reference, hypothesis in zip(references, hypotheses):
        e, n = word_errors(reference, hypothesis)
        errors, words = errors + e, words + n
    return errors / max(words, 1)
