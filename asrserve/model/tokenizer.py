"""Whisper's tokenizer: BPE text from tokenizer.json plus the special-token ids the engine needs.

Special tokens sit at fixed offsets from the end of the vocabulary (1501 timestamp tokens, then
<|notimestamps|>, <|nospeech|>, ... back to <|startoftranscript|>), so their ids follow from the
model's vocabulary size alone. That is how dummy checkpoints get real ids, and it covers
tokenizer files that omit the timestamp tokens (tiny.en's does). Where the tokenizer file has
a special token we check that it agrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

from asrserve.errors import ModelLoadError
from asrserve.model.languages import LANGUAGES

NUM_TIMESTAMP_TOKENS = 1501  # <|0.00|> ... <|30.00|> in steps of 0.02 s
SECONDS_PER_TIMESTAMP = 0.02
# A prompt (<|startofprev|> text) keeps its last half-context less one tokens, as Whisper does.
MAX_PROMPT_TOKENS = 223
PROMPT_TAIL_CHARS = 4096  # enough text for 3 * MAX_PROMPT_TOKENS tokens, unless they are long ones
ENGLISH_EOT = 50256  # the GPT-2 vocabulary's <|endoftext|>; multilingual models have one more


@dataclass(frozen=True)
class SpecialTokens:
    eot: int
    sot: int
    translate: int
    transcribe: int
    sot_lm: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    timestamp_begin: int
    language_ids: dict[str, int] = field(repr=False)

    @classmethod
    def for_vocab(cls, vocab_size: int) -> "SpecialTokens":
        multilingual = vocab_size >= 51865
        eot = ENGLISH_EOT + int(multilingual)
        timestamp_begin = vocab_size - NUM_TIMESTAMP_TOKENS
        translate = timestamp_begin - 6
        num_languages = translate - (eot + 2)
        if not 1 <= num_languages <= len(LANGUAGES):
            raise ValueError(f"vocabulary size {vocab_size} is not a Whisper vocabulary")
        language_ids = {code: eot + 2 + i for i, code in enumerate(list(LANGUAGES)[:num_languages])}
        return cls(
            eot=eot,
            sot=eot + 1,
            translate=translate,
            transcribe=translate + 1,
            sot_lm=translate + 2,
            sot_prev=translate + 3,
            no_speech=translate + 4,
            no_timestamps=translate + 5,
            timestamp_begin=timestamp_begin,
            language_ids=language_ids,
        )


class WhisperTokenizer:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, verify: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.special = SpecialTokens.for_vocab(vocab_size)
        self.is_multilingual = vocab_size >= 51865
        self._language_by_id = {token_id: code for code, token_id in self.special.language_ids.items()}
        if verify:
            self._check_against_file()

    @classmethod
    def from_dir(cls, path: Path, vocab_size: int) -> "WhisperTokenizer":
        tokenizer_json = path / "tokenizer.json"
        if tokenizer_json.is_file():
            return cls(Tokenizer.from_file(str(tokenizer_json)), vocab_size)
        # vocab.json + merges.txt only: let transformers assemble the fast tokenizer (without
        # them it builds a one-token tokenizer, which would be blamed on the weights).
        if not ((path / "vocab.json").is_file() and (path / "merges.txt").is_file()):
            raise ModelLoadError(f"no tokenizer in {path}: it needs tokenizer.json, or vocab.json and merges.txt")
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)).backend_tokenizer, vocab_size)

    def _check_against_file(self) -> None:
        names = {
            "<|endoftext|>": self.special.eot,
            "<|startoftranscript|>": self.special.sot,
            "<|notimestamps|>": self.special.no_timestamps,
        }
        if self.is_multilingual:
            names |= {"<|transcribe|>": self.special.transcribe, "<|translate|>": self.special.translate}
        for name, expected in names.items():
            found = self.tokenizer.token_to_id(name)
            if found is not None and found != expected:
                raise ValueError(
                    f"tokenizer has {name} at id {found} but a {self.vocab_size}-token Whisper "
                    f"vocabulary puts it at {expected}: tokenizer and weights do not match"
                )

    @property
    def languages(self) -> list[str]:
        return list(self.special.language_ids) if self.is_multilingual else ["en"]

    def encode(self, text: str) -> list[int]:
        """Ordinary tokens only: text that spells a special token ("<|endoftext|>", "<|de|>",
        "<|0.00|>") is encoded as the characters it is, as openai/whisper's tokenizer does.
        Tokenizer.encode would match it as the control token: a prompt could end the previous
        text, name a language or a task, or place a timestamp."""
        tokenizer = self.tokenizer
        if tokenizer.pre_tokenizer is None:
            return tokenizer.encode(text, add_special_tokens=False).ids
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        pieces = tokenizer.pre_tokenizer.pre_tokenize_str(text)
        return [token.id for piece, _ in pieces for token in tokenizer.model.tokenize(piece)]

    def decode(self, token_ids: list[int]) -> str:
        """Text of the ordinary tokens; special and timestamp tokens are dropped."""
        return self.tokenizer.decode([t for t in token_ids if t < self.special.eot], skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a text token stands for. Whisper's BPE is byte-level: a character split
        across tokens (much of Japanese and Chinese) is part of its UTF-8 bytes in each, where
        decode([token]) gives U+FFFD; joined, the bytes are the text again."""
        piece = self.tokenizer.id_to_token(token)
        table = _unicode_to_byte()
        if piece is None or any(char not in table for char in piece):  # not a byte-level vocabulary
            return self.decode([token]).encode("utf-8")
        return bytes(table[char] for char in piece)

    def sot_sequence(
        self, language: str | None, task: str, timestamps: bool = False, previous_tokens: list[int] | None = None
    ) -> list[int]:
        """The decoder prompt: [<|startofprev|> previous text] <|startoftranscript|> [language,
        task] [<|notimestamps|>]. English-only models take no language or task token; without a
        language the prompt stops at <|startoftranscript|> and the first step detects it. With
        timestamps the model writes <|t|> tokens around each segment instead."""
        prefix = [self.special.sot_prev, *previous_tokens[-MAX_PROMPT_TOKENS:]] if previous_tokens else []
        if not self.is_multilingual:
            return [*prefix, self.special.sot, *([] if timestamps else [self.special.no_timestamps])]
        if language is None:
            return [*prefix, self.special.sot]
        return [*prefix, self.special.sot, *self.task_tokens(language, task, timestamps)]

    def prompt_tokens(self, prompt: str) -> list[int]:
        """A user's prompt as previous text: one leading space, as if it preceded the audio.

        Only the last MAX_PROMPT_TOKENS are ever read, so a long prompt is tokenized from its
        end: whole, a 64 KB prompt took the engine ~80 ms of every request that carried it (a
        live session's every decode). The tokens next to the cut can differ from the whole
        text's; hundreds of tokens after it (all that is returned) are the whole text's. Blank
        text has none."""
        if not prompt.strip():
            return []
        text = " " + prompt.strip()
        tail = PROMPT_TAIL_CHARS
        while len(text) > tail:
            tokens = self.encode(text[-tail:])
            if len(tokens) > 3 * MAX_PROMPT_TOKENS:
                return tokens[-2 * MAX_PROMPT_TOKENS:]
            tail *= 4  # tokens of many characters each (runs of symbols)
        return self.encode(text)

    def head_tokens(self, head: str) -> list[int]:
        """Text read in front of a prompt and kept whole when the prompt is cut (a request's
        keywords), as previous text: its first MAX_PROMPT_TOKENS (none for blank text)."""
        if not head.strip():
            return []
        return self.encode(" " + head.strip()[:PROMPT_TAIL_CHARS])[:MAX_PROMPT_TOKENS]

    def num_prompt_tokens(self, prompt: str | None, head: str | None = None) -> int:
        """The tokens of a prompt (and of the head read in front of it) that a decode reads."""
        return len(fit_prompt(self.head_tokens(head or ""), self.prompt_tokens(prompt or ""), MAX_PROMPT_TOKENS))

    def task_tokens(self, language: str, task: str, timestamps: bool = False) -> list[int]:
        task_id = self.special.translate if task == "translate" else self.special.transcribe
        return [self.special.language_ids[language], task_id, *([] if timestamps else [self.special.no_timestamps])]

    def is_timestamp(self, token_id: int) -> bool:
        return token_id >= self.special.timestamp_begin

    def timestamp_seconds(self, token_id: int) -> float:
        return (token_id - self.special.timestamp_begin) * SECONDS_PER_TIMESTAMP

    def timestamp_token(self, seconds: float) -> int:
        return self.special.timestamp_begin + round(seconds / SECONDS_PER_TIMESTAMP)

    def language_of(self, token_id: int) -> str:
        return self._language_by_id[token_id]


def fit_prompt(head: list[int], prompt: list[int], room: int) -> list[int]:
    """At most `room` tokens of previous text: the head (a request's keywords) first, whole
    unless it and the prompt together overrun the room, where the head keeps at least half of
    it, then the prompt's last tokens (those nearest the audio, as Whisper keeps them)."""
    if room <= 0:
        return []
    if len(head) + len(prompt) <= room:
        return head + prompt
    head = head[: max(room - len(prompt), room // 2)]
    return head + prompt[len(prompt) - (room - len(head)):] if room > len(head) else head


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: the printable Latin-1 bytes
    as themselves, the other 68 (controls, space, ...) as the characters from U+0100 on, in
    byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if chr(byte) not in table]
    table |= {chr(256 + index): byte for index, byte in enumerate(others)}
    return table
