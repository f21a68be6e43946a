"""Word error rate with Whisper's English text normaliser, as Whisper's own evaluations compute it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

INSTALL_HINT = "pip install 'asrserve[bench]'"


def english_normalizer() -> Callable[[str], str]:
    """openai/whisper's EnglishTextNormalizer (numbers, contractions, British spellings...),
    from the `whisper-normalizer` package."""
    try:
        from whisper_normalizer.english import EnglishTextNormalizer
    except ImportError:
        raise RuntimeError(f"WER needs Whisper's English normaliser: {INSTALL_HINT}") from None
    return EnglishTextNormalizer()


def word_errors(reference: Sequence[str], hypothesis: Sequence[str]) -> int:
    """Levenshtein distance between two word sequences: substitutions + deletions + insertions."""
    previous = list(range(len(hypothesis) + 1))
    for i, ref_word in enumerate(reference, 1):
        current = [i] + [0] * len(hypothesis)
        for j, hyp_word in enumerate(hypothesis, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref_word != hyp_word))
        previous = current
    return previous[-1]


def corpus_wer(references: Sequence[str], hypotheses: Sequence[str], normalize: Callable[[str], str]) -> float:
    """Errors over all pairs / reference words over all pairs (not a mean of per-file rates)."""
    errors = words = 0
    for reference, hypothesis in zip(references, hypotheses, strict=True):
        ref, hyp = normalize(reference).split(), normalize(hypothesis).split()
        errors += word_errors(ref, hyp)
        words += len(ref)
    return errors / max(words, 1)
