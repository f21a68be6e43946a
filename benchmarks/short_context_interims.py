"""Would an interim decode over a shorter encoder context read the same words, and how much
cheaper would it be?

    python benchmarks/short_context_interims.py [--model tiny.en] [--hop-s 0.5] [--pad-s 1,3]

Every live interim decode (entrypoints.live_decode) runs the encoder over a whole 30 s window
(1500 positions), however little audio the turn has so far: on 2 float32 cores that is most of
an interim's cost, and what keeps interims from coming every 0.5 s. whisper.cpp's `audio_ctx`
runs the encoder over only the first positions (the audio there is plus some padding), slicing
the positional embeddings; Whisper was trained on full windows only, so it is not known to read
the same. This measures it before the engine gets such a path: for every utterance of
benchmarks/live_stability.py (the English recordings of ../shared/audio up to 30 s and espeak-ng
Harvard sentences) and every growing prefix of it, one hop apart, a greedy decode without
timestamps over the full window and over a context of the prefix plus `pad` seconds, in
transformers' model on the same weights (float32). It prints how often the short context reads
exactly the same text, the WER of its text against the full window's (Whisper's English
normaliser), and the encoder's time per decode for each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import WhisperFeatureExtractor
from transformers.modeling_outputs import BaseModelOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.benchmark.wer import corpus_wer, english_normalizer
from asrserve.config import SAMPLE_RATE
from asrserve.model.loader import _bundled
from asrserve.model.tokenizer import WhisperTokenizer
from benchmarks.live_stability import MIN_INTERIM_S, utterances
from tests.hf_reference import bundled_hf_model

FRAMES_PER_SECOND = 50  # encoder positions per second of audio (two 10 ms mel frames each)


def encode(model, features: torch.Tensor, positions: int) -> torch.Tensor:
    """The encoder over the first `positions` positions only (features [1, mels, 3000])."""
    encoder = model.model.encoder
    x = torch.nn.functional.gelu(encoder.conv1(features[:, :, : 2 * positions]))
    x = torch.nn.functional.gelu(encoder.conv2(x)).permute(0, 2, 1)
    x = x + encoder.embed_positions.weight[:positions]
    for layer in encoder.layers:
        x = layer(x, attention_mask=None)
    return encoder.layer_norm(x)


def greedy(model, generation, hidden: torch.Tensor) -> list[int]:
    """Greedy text tokens without timestamps, for encoder states of any length."""
    prompt = [generation.decoder_start_token_id, generation.no_timestamps_token_id]
    out = model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=hidden),
                         decoder_input_ids=torch.tensor([prompt]), generation_config=generation,
                         return_timestamps=False)
    return [t for t in out[0].tolist() if t < generation.eos_token_id]  # the prompt too, if returned


def cut_at_repetition(text: str, n: int = 4) -> str:
    """The text up to where a run of n words comes again (a decode looping over the end of a
    short context repeats what it read): what a guard in the live rule could keep."""
    words = text.split()
    key = [w.strip(".,!?;:").lower() for w in words]
    seen = set()
    for i in range(len(words) - n + 1):
        gram = tuple(key[i:i + n])
        if gram in seen:
            return " ".join(words[:i])
        seen.add(gram)
    return text


def kept_by_next_decode(texts: list[str], full: list[str], pairs: list[tuple[int, int]], normalizer) -> float:
    """Of the words of each decode but its last two (which the live rule never sends), the share
    that the next full-window decode of the same utterance, one hop later, begins with: how much
    of an interim the next one confirms."""
    agreed = total = 0
    for this, following in pairs:
        head, later = normalizer(texts[this]).split()[:-2], normalizer(full[following]).split()
        total += len(head)
        for a, b in zip(head, later):
            if a != b:
                break
            agreed += 1
    return agreed / max(1, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--hop-s", type=float, default=0.5)
    parser.add_argument("--pad-s", default="1,3", help="seconds of context past the audio, comma-separated")
    parser.add_argument("--espeak", type=int, default=8)
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    model, generation = bundled_hf_model(args.model)
    generation.max_length, generation.max_new_tokens = None, 128
    checkpoint = _bundled(args.model)
    tokenizer_dir = next(d for d in checkpoint.directories if (d / "tokenizer.json").is_file())
    tokenizer = WhisperTokenizer.from_dir(tokenizer_dir, model.config.vocab_size)
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    with tempfile.TemporaryDirectory() as directory:
        items = utterances(Path(directory), args.espeak, multilingual=False)
    pads = [float(p) for p in args.pad_s.split(",")]
    full: list[str] = []
    short: dict[float, list[str]] = {pad: [] for pad in pads}
    seconds: dict[float | None, list[float]] = {None: [], **{pad: [] for pad in pads}}  # encoder, None: full
    utterance_of: list[int] = []
    for index, (name, audio, _, _) in enumerate(items):
        end = MIN_INTERIM_S
        while end * SAMPLE_RATE < len(audio):
            prefix = audio[: int(end * SAMPLE_RATE)]
            features = extractor(prefix, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
            started = time.perf_counter()
            hidden = encode(model, features, 1500)
            seconds[None].append(time.perf_counter() - started)
            full.append(tokenizer.decode(greedy(model, generation, hidden)).strip())
            utterance_of.append(index)
            for pad in pads:
                positions = min(1500, int(np.ceil((end + pad) * FRAMES_PER_SECOND)))
                started = time.perf_counter()
                hidden = encode(model, features, positions)
                seconds[pad].append(time.perf_counter() - started)
                short[pad].append(tokenizer.decode(greedy(model, generation, hidden)).strip())
            end += args.hop_s
        print(f"{name}: {len(full)} prefixes so far", flush=True)
    normalizer = english_normalizer()
    pairs = [(i, i + 1) for i in range(len(full) - 1) if utterance_of[i] == utterance_of[i + 1]]
    kept = kept_by_next_decode(full, full, pairs, normalizer)
    rows = [{"context": "30 s window", "encoder_ms_mean": round(1000 * float(np.mean(seconds[None])), 1),
             "kept_by_next_decode": round(kept, 3)}]
    print(f"{len(items)} utterances, {len(full)} prefixes one {args.hop_s} s hop apart; {args.model}, float32")
    print(f"  full 30 s window: encoder {rows[0]['encoder_ms_mean']} ms per decode (mean); the next decode begins with "
          f"{kept * 100:.0f} % of its words but the last two")
    variants = [(f"prefix + {pad:g} s", short[pad], pad) for pad in pads]
    variants += [(f"prefix + {pad:g} s, cut where it repeats", [cut_at_repetition(t) for t in short[pad]], pad)
                 for pad in pads]
    for label, texts, pad in variants:
        same = sum(normalizer(a) == normalizer(b) for a, b in zip(full, texts)) / len(full)
        wer = corpus_wer(full, texts, normalizer)
        kept = kept_by_next_decode(texts, full, pairs, normalizer)
        row = {"context": label, "encoder_ms_mean": round(1000 * float(np.mean(seconds[pad])), 1),
               "same_text": round(same, 3), "wer_against_full_window": round(wer, 4),
               "kept_by_next_decode": round(kept, 3)}
        rows.append(row)
        print(f"  {label}: encoder {row['encoder_ms_mean']} ms per decode (mean); same text as the full "
              f"window on {same * 100:.0f} % of prefixes; WER against it {wer * 100:.1f} %; the next full-window "
              f"decode begins with {kept * 100:.0f} % of its words but the last two")
    if args.save_result:
        texts = [{"full": a, **{f"pad {pad:g}": short[pad][i] for pad in pads}} for i, a in enumerate(full)]
        args.save_result.write_text(json.dumps({"command": " ".join(sys.argv), "model": args.model, "hop_s": args.hop_s,
                                                "prefixes": len(full), "rows": rows, "texts": texts}, indent=1) + "\n")


if __name__ == "__main__":
    main()
