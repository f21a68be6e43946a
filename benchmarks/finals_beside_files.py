"""A live turn's final decode beside running file decodes, with file sequences sitting out its
steps (SchedulerConfig.finals_alone, the CPU default) and without: the engine alone, no HTTP.

--files file requests (real speech pieces, decoding --file-tokens tokens each, end of text
ignored so they keep running) are admitted first; then, --finals times, one urgent request
(a recording of speech, as a live turn's final decode) is added and the engine stepped until
it finishes. Prints, for each setting, the final's wall time from add to finish (median and
worst) and the file tokens decoded meanwhile per second of it (what file work kept).

    python benchmarks/finals_beside_files.py [--files 16] [--finals 8] [--save-result FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.audio.decode import load_audio  # noqa: E402
from asrserve.config import SAMPLE_RATE, EngineConfig, SchedulerConfig  # noqa: E402
from asrserve.engine.engine_core import EngineCore  # noqa: E402
from asrserve.engine.request import SamplingParams  # noqa: E402
from benchmarks.workloads import SHARED_AUDIO  # noqa: E402

FINAL_AUDIO = "openai-whisper__jfk.flac"  # 11 s: "And so my fellow Americans ..."
FILE_AUDIO = ("leopard__test.wav", "mfa__61-70968-0000.flac", "wenet__librispeech-1995-1837-0001.wav")


def run(finals_alone: bool, num_files: int, num_finals: int, file_tokens: int) -> dict:
    engine = EngineCore(EngineConfig(scheduler=SchedulerConfig(finals_alone=finals_alone)))
    final_audio = load_audio(SHARED_AUDIO / FINAL_AUDIO)
    file_audio = [load_audio(SHARED_AUDIO / name)[: 30 * SAMPLE_RATE] for name in FILE_AUDIO]
    file_params = SamplingParams(ignore_eos=True, max_tokens=file_tokens, stream_tokens=True)
    for i in range(num_files):
        engine.add_request(f"file{i}", file_audio[i % len(file_audio)], language="en", sampling_params=file_params)
    file_ids = {f"file{i}" for i in range(num_files)}
    while any(r.num_computed_tokens == 0 for r in engine.scheduler.requests.values()):  # all admitted
        engine.step()
    durations, file_rates, texts = [], [], set()
    for n in range(num_finals):
        request_id = f"final{n}"
        file_tokens_before = _file_tokens(engine, file_ids)
        start = time.perf_counter()
        engine.add_request(request_id, final_audio, language="en", urgent=True)
        tokens, done = [], False
        while not done:
            for output in engine.step():
                if output.request_id == request_id:
                    tokens += output.new_token_ids
                    done = output.finished
        elapsed = time.perf_counter() - start
        durations.append(elapsed)
        file_rates.append((_file_tokens(engine, file_ids) - file_tokens_before) / elapsed)
        texts.add(engine.tokenizer.decode(tokens))
        if len(file_ids & set(engine.scheduler.requests)) < num_files:
            raise SystemExit("file requests finished during the finals: give them more --file-tokens")
    return {"finals_alone": finals_alone, "final_ms_median": round(1000 * statistics.median(durations), 1),
            "final_ms_max": round(1000 * max(durations), 1),
            "file_tokens_per_s_median": round(statistics.median(file_rates), 1), "final_texts": sorted(texts)}


def _file_tokens(engine: EngineCore, file_ids: set[str]) -> int:
    return sum(len(r.output_token_ids) for r in engine.scheduler.requests.values() if r.request_id in file_ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--finals", type=int, default=8)
    parser.add_argument("--file-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2, help="each setting this many times, in turns")
    parser.add_argument("--save-result", type=Path)
    args = parser.parse_args()
    if not (SHARED_AUDIO / FINAL_AUDIO).exists():
        raise SystemExit(f"needs ../shared/audio ({SHARED_AUDIO})")
    results = []
    for _ in range(args.rounds):
        for finals_alone in (True, False):
            result = run(finals_alone, args.files, args.finals, args.file_tokens)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.save_result:
        args.save_result.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
