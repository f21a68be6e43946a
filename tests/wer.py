"""Word error rate for tests: lower-case, drop punctuation, spell digits as they were read."""

from __future__ import annotations

import re

_NUMBERS = {str(i): w for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}


def normalize(text: str) -> list[str]:
    text = re.sub(r"[^\w\s']", " ", text.lower()).replace("'", "")
    return [_NUMBERS.get(word, word) for word in text.split()]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    ref, hyp = normalize(reference), normalize(hypothesis)
    previous = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, 1):
        current = [i] + [0] * len(hyp)
        for j, hyp_word in enumerate(hyp, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref_word != hyp_word))
        previous = current
    return previous[-1], len(ref)


def corpus_wer(references: list[str], hypotheses: list[str]) -> float:
    errors = words = 0
    for reference, hypothesis in zip(references, hypotheses):
        e, n = word_errors(reference, hypothesis)
        errors, words = errors + e, words + n
    return errors / max(words, 1)
