"""Words from tokens: which output tokens make up each word, with punctuation attached to its
word, as openai/whisper groups them for word timestamps."""

from __future__ import annotations

import string

from asrserve.model.languages import NO_SPACE_LANGUAGES
from asrserve.model.tokenizer import WhisperTokenizer

# Punctuation that joins the word after it, and punctuation that joins the word before it.
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


def split_on_characters(tokenizer: WhisperTokenizer, token_ids: list[int]) -> list[tuple[str, list[int]]]:
    """Groups tokens into the smallest runs that decode to whole characters (byte-level BPE
    splits some characters, e.g. CJK, across tokens)."""
    units: list[tuple[str, list[int]]] = []
    pending: list[int] = []
    for token in token_ids:
        pending.append(token)
        text = tokenizer.decode(pending)
        if "\ufffd" not in text:
            units.append((text, pending))
            pending = []
    if pending:
        units.append((tokenizer.decode(pending), pending))
    return units


def split_on_spaces(tokenizer: WhisperTokenizer, token_ids: list[int]) -> list[tuple[str, list[int]]]:
    """A new word starts at a leading space or a punctuation mark."""
    words: list[tuple[str, list[int]]] = []
    for text, tokens in split_on_characters(tokenizer, token_ids):
        starts_word = text.startswith(" ") or text.strip() in string.punctuation
        if starts_word or not words:
            words.append((text, list(tokens)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + tokens)
    return words


def merge_punctuation(words: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """Opening punctuation joins the following word; closing punctuation the preceding one."""
    merged = list(words)
    i = len(merged) - 2
    while i >= 0:
        text, tokens = merged[i]
        if text.startswith(" ") and text.strip() and text.strip() in PREPEND_PUNCTUATION:
            following_text, following_tokens = merged[i + 1]
            merged[i + 1] = (text + following_text.lstrip(), tokens + following_tokens)
            merged[i] = ("", [])
        i -= 1
    result: list[tuple[str, list[int]]] = []
    for text, tokens in merged:
        if not tokens:
            continue
        if result and not result[-1][0].endswith(" ") and text in APPEND_PUNCTUATION:
            result[-1] = (result[-1][0] + text, result[-1][1] + tokens)
        else:
            result.append((text, tokens))
    return result


def split_words(tokenizer: WhisperTokenizer, token_ids: list[int], language: str | None) -> list[tuple[str, int]]:
    """(word, number of tokens) for text tokens, in order; the counts add up to len(token_ids)."""
    if language in NO_SPACE_LANGUAGES:
        words = split_on_characters(tokenizer, token_ids)
    else:
        words = split_on_spaces(tokenizer, token_ids)
    return [(text, len(tokens)) for text, tokens in merge_punctuation(words)]
