"""Do draft tokens (engine/draft.py) leave a decode's output as it was, on this device? Each
recording is decoded greedily alone, then again with drafts made from that output: right,
one token changed, one missing, one extra, wrong throughout, the first half. Reports how many
drafted decodes gave the same tokens, the largest log-probability difference, and the engine
steps with and without:

    python benchmarks/draft_exactness.py MODEL AUDIO_DIR [--device cuda] [--dtype float32]

AUDIO_DIR: audio files of up to 30 s (e.g. the "real" folder `benchmarks/dtype_accuracy.py --write-sets`
writes, or ../shared/audio). Exits 1 when a float32 decode changed or a KV block was not freed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.audio.decode import load_audio
from asrserve.config import SAMPLE_RATE, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from asrserve.engine.engine_core import EngineCore
from asrserve.engine.request import RequestOutput, SamplingParams

AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg"}


def decode_alone(
    engine: EngineCore, request_id: str, audio, language: str, **kwargs
) -> tuple[list[int], list[float], int, RequestOutput]:
    """Tokens, log-probabilities, engine steps and last output of one request run alone
    (kwargs: add_request's; sampling_params greedy with Whisper's fallback by default)."""
    params = kwargs.pop("sampling_params", None) or SamplingParams.transcription(0.0)
    engine.add_request(request_id, audio, language, sampling_params=params, **kwargs)
    tokens, logprobs, steps, last = [], [], 0, None
    while engine.has_work():
        steps += 1
        for output in engine.step():
            if output.restarted:
                tokens, logprobs = [], []
            tokens += output.new_token_ids
            logprobs += output.new_logprobs
            if output.finished:
                last = output
    return tokens, logprobs, steps, last


def decode(
    engine: EngineCore, audio, language: str, draft: list[int] | None = None
) -> tuple[list[int], list[float], int]:
    """Tokens, log-probabilities and engine steps of one greedy request run alone."""
    # one greedy decode: a retry at a temperature above 0 would sample, with or without a draft
    params = SamplingParams.transcription(0.0, decode_once=True)
    return decode_alone(engine, "r", audio, language, sampling_params=params, draft=draft)[:3]


def drafts(text: list[int], eot: int) -> dict[str, list[int]]:
    """Guesses a decode may get from `text` (its text tokens): right, one token changed, one
    missing, one extra, wrong throughout, the first half."""
    changed = text[:3] + [(token + 1) % eot for token in text[3:4]] + text[4:]
    return {
        "exact": text, "changed": changed, "missing": text[:4] + text[5:], "extra": text[:4] + [1000] + text[4:],
        "wrong": [1000 + i for i in range(20)], "first half": text[: len(text) // 2],
    }


def where_they_differ(engine: EngineCore, plain: list[int], drafted: list[int]) -> str:
    """The first token where two decodes part, as text around it."""
    index = next((i for i, (a, b) in enumerate(zip(plain, drafted)) if a != b), min(len(plain), len(drafted)))
    decode_text = engine.tokenizer.decode
    before = decode_text(plain[max(0, index - 4):index])
    return f"...{before}[{decode_text(plain[index:index + 2])!r} -> {decode_text(drafted[index:index + 2])!r}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("audio_dir", type=Path)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--language", default="en")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = EngineCore(EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device),
        cache=CacheConfig(), scheduler=SchedulerConfig(max_num_seqs=8)))
    eot = engine.tokenizer.special.eot
    files = sorted(p for p in args.audio_dir.iterdir() if p.suffix in AUDIO_SUFFIXES)
    result = {"device": str(engine.device), "dtype": str(engine.dtype), "decodes": 0, "same_tokens": 0,
              "max_logprob_diff": 0.0, "steps_plain": 0, "steps_exact_draft": 0, "changed": []}
    for path in files:
        audio = load_audio(path)
        if len(audio) > 30 * SAMPLE_RATE:  # one engine request reads at most 30 s
            continue
        tokens, logprobs, steps = decode(engine, audio, args.language)
        result["steps_plain"] += steps
        for name, draft in drafts([t for t in tokens if t < eot][: engine.dims.n_text_ctx // 2], eot).items():
            drafted, drafted_logprobs, drafted_steps = decode(engine, audio, args.language, draft)
            result["decodes"] += 1
            if drafted == tokens:
                result["same_tokens"] += 1
                diff = max((abs(a - b) for a, b in zip(logprobs, drafted_logprobs)), default=0.0)
                result["max_logprob_diff"] = max(result["max_logprob_diff"], diff)
            else:
                result["changed"].append(f"{path.name}: {name}: {where_they_differ(engine, tokens, drafted)}")
            if name == "exact":
                result["steps_exact_draft"] += drafted_steps
    manager = engine.scheduler.block_manager
    result["blocks_back"] = manager.num_free_blocks == manager.num_blocks
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    exact = engine.dtype.is_floating_point and engine.dtype.itemsize == 4
    return 1 if (exact and result["changed"]) or not result["blocks_back"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
