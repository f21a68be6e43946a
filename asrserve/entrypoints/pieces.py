"""What one audio piece's engine request produced, gathered from its outputs, and the
transcript text of several pieces joined."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from asrserve.config import CHUNK_SECONDS
from asrserve.engine.request import DecodeSummary, RequestOutput, SamplingParams
from asrserve.model.languages import NO_SPACE_LANGUAGES
from asrserve.model.tokenizer import WhisperTokenizer


@dataclass
class PieceResult:
    offset_s: float  # where the piece starts in the whole audio
    duration_s: float
    token_ids: list[int] = field(default_factory=list)  # sampled tokens, timestamps included
    logprobs: list[float] = field(default_factory=list)
    language: str | None = None
    summary: DecodeSummary | None = None  # once finished
    finish_reason: str | None = None
    is_continuation: bool = False  # decodes the rest of the piece before it (entrypoints.continuation)
    cut_in_segment: bool = False  # max_completion_tokens fell inside its last segment (truncate_text)

    def add(self, output: RequestOutput) -> None:
        if output.restarted:  # a temperature fallback: what came before is void
            self.token_ids.clear()
            self.logprobs.clear()
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs)
        if output.language is not None:
            self.language = output.language
        if output.finished:
            self.summary = output.summary
            self.finish_reason = output.finish_reason

    @property
    def is_silence(self) -> bool:
        return self.summary is not None and self.summary.no_speech

    def truncate_text(self, max_text_tokens: int, eot: int) -> None:
        """Keeps the tokens up to the max_text_tokens-th text token (max_completion_tokens). A
        segment cut short keeps its closing timestamp: it ended there (without it, it would
        run to the end of the piece)."""
        kept, num_text = [], 0
        for token in self.token_ids:
            if token < eot:
                if num_text == max_text_tokens:
                    break
                num_text += 1
            kept.append(token)
        cut = len(kept)
        closing = next((i for i in range(cut, len(self.token_ids)) if self.token_ids[i] > eot), None)
        if kept and kept[-1] < eot and closing is not None:
            self.token_ids[cut], self.logprobs[cut] = self.token_ids[closing], self.logprobs[closing]
            cut += 1
            self.cut_in_segment = True
        del self.token_ids[cut:]
        del self.logprobs[cut:]

    def num_text_tokens(self, eot: int) -> int:
        return sum(1 for token in self.token_ids if token < eot)


def long_form_params(params: SamplingParams, duration_s: float) -> SamplingParams:
    """Audio longer than 30 s decodes with timestamp tokens whatever the response format asks
    for, as openai/whisper's and faster-whisper's long-form transcription do: without them
    Whisper drops whole sentences of a dense 30 s piece, and seek continuation needs the
    segments' ends. The response drops the timestamps again."""
    if duration_s > CHUNK_SECONDS and not params.timestamps:
        return replace(params, timestamps=True)
    return params


def decode_to_the_end(params: SamplingParams) -> SamplingParams:
    """What the engine decodes for a request whose text is cut at params.max_tokens: with
    word timestamps, each piece to its end, the cut made after (PieceResult.truncate_text).
    Word times align a decode up to its end, and one stopped at the limit has none: its few
    words were spread over the whole piece. (Without words, a timestamped decode stops at the
    timestamp closing the segment the limit falls in: Request.at_length_limit.)"""
    if params.word_timestamps and params.max_tokens is not None and not params.ignore_eos:
        return replace(params, max_tokens=None)
    return params


def cap_text_tokens(pieces: list[PieceResult], limit: int | None, eot: int) -> int:
    """Cuts the transcript at `limit` text tokens (max_completion_tokens: the whole transcript,
    not each piece): a piece keeps what is left of the limit and the pieces after the one that
    reaches it go. Returns the text tokens kept."""
    kept = 0
    for index, piece in enumerate(pieces):
        if piece.is_silence:
            continue
        if limit is not None:
            piece.truncate_text(limit - kept, eot)
        kept += piece.num_text_tokens(eot)
        if limit is not None and kept >= limit:
            del pieces[index + 1 :]
            break
    return kept


def joiner(before: str | None, after: str | None) -> str:
    """What joins the texts of two pieces in these languages: nothing between two written
    without spaces (zh, ja, ...), a space otherwise (a German part after a Japanese one)."""
    return "" if before in NO_SPACE_LANGUAGES and after in NO_SPACE_LANGUAGES else " "


def written_in(language: str | None, task: str) -> str | None:
    """The language a piece's text is written in: its speech's, or English for a translation
    (whose texts are joined and split into words as English, whatever was spoken)."""
    return "en" if task == "translate" else language


def spoken_language(pieces: list[PieceResult], default: str | None, allowed: Sequence[str] = ()) -> str | None:
    """The first language heard in time: pieces judged silence say nothing (Whisper "detects"
    Welsh or Nynorsk in near-silence). Where nothing was heard and the request listed the
    languages the audio may be in, one of those: a silent piece's detection (made among them),
    else the first listed."""
    heard = next((piece.language for piece in pieces if piece.language and not piece.is_silence), default)
    if heard is not None or not allowed:
        return heard
    return next((piece.language for piece in pieces if piece.language in allowed), allowed[0])


def transcript_text(tokenizer: WhisperTokenizer, pieces: list[PieceResult], language: str | None,
                    task: str = "transcribe") -> str:
    """The pieces' texts in order, stripped and joined (each pair by joiner, a piece's own
    language first, `language` where it has none; English for a translation); pieces judged
    silence contribute nothing."""
    text, previous = "", None
    for piece in pieces:
        piece_text = "" if piece.is_silence else tokenizer.decode(piece.token_ids).strip()
        if piece_text:
            current = written_in(piece.language or language, task)
            text += (joiner(previous, current) if text else "") + piece_text
            previous = current
    return text
