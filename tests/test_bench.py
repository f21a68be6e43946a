"""`asrserve bench`: workload and manifest parsing, WER with Whisper's normaliser, and full runs
against a real server (sweep, streaming, saved JSON, plot, failures)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asrserve.benchmark.wer import corpus_wer, english_normalizer, word_errors
from asrserve.benchmark.workload import load_workload, read_manifest
from tests.conftest import SENTENCES
from tests.server_utils import ServerProcess

API_KEY = "bench-key"


def test_word_errors_counts_edits():
    assert word_errors("a b c".split(), "a b c".split()) == 0
    assert word_errors("a b c".split(), "a x c".split()) == 1
    assert word_errors("a b c".split(), "a c".split()) == 1
    assert word_errors("a b c".split(), "a b c d e".split()) == 2
    assert word_errors([], "a".split()) == 1


def test_wer_uses_whispers_english_normaliser():
    normalize = english_normalizer()
    # Numbers, titles, contractions, British spellings and punctuation are normalised away.
    assert corpus_wer(["Mr. Smith paid twenty-five dollars."], ["mister smith paid $25"], normalize) == 0
    assert corpus_wer(["He won't go, it's organised."], ["he will not go it is organized"], normalize) == 0
    assert corpus_wer(["the colour"], ["the collar"], normalize) == 0.5
    # Pooled over the corpus, not averaged per file: 1 error in 2 + 4 words.
    assert corpus_wer(["red fox", "a big blue whale"], ["red fox", "a big blue"], normalize) == 1 / 6


def test_manifest_formats_and_errors(tmp_path):
    (tmp_path / "m.tsv").write_text("file\tduration\treference_transcript\na.wav\t1.0\tHello there.\n")
    assert read_manifest(tmp_path / "m.tsv") == {"a.wav": "Hello there."}
    (tmp_path / "m.csv").write_text("path,text\nb.flac,\"Hi, you.\"\n")
    assert read_manifest(tmp_path / "m.csv") == {"b.flac": "Hi, you."}
    (tmp_path / "m.jsonl").write_text('{"file": "c.mp3", "text": "Yes."}\n\n{"file": "d.mp3", "text": "No."}\n')
    assert read_manifest(tmp_path / "m.jsonl") == {"c.mp3": "Yes.", "d.mp3": "No."}
    (tmp_path / "bad.tsv").write_text("name\twords\na.wav\thello\n")
    with pytest.raises(ValueError, match="needs a file column"):
        read_manifest(tmp_path / "bad.tsv")


def test_workload_reads_folder_and_checks_manifest(speech_files, tmp_path):
    folder = speech_files[0].parent
    files = load_workload(folder)
    assert [f.name for f in files] == sorted(p.name for p in folder.glob("*.wav"))
    assert all(f.reference is None and f.mime_type == "audio/x-wav" for f in files)
    assert 0.3 < files[1].duration_s < 10
    manifest = tmp_path / "m.tsv"
    manifest.write_text(f"file\ttext\n{speech_files[1].name}\t{SENTENCES[1]}\n")
    only = load_workload(folder, manifest)
    assert [(f.name, f.reference) for f in only] == [(speech_files[1].name, SENTENCES[1])]
    manifest.write_text("file\ttext\nmissing.wav\thello\n")
    with pytest.raises(ValueError, match="not in"):
        load_workload(folder, manifest)
    with pytest.raises(ValueError, match="no audio files"):
        load_workload(tmp_path)


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(["--api-key", API_KEY])
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def workload(speech_files, tmp_path_factory) -> tuple[Path, Path]:
    """Four clips and a manifest of what they say."""
    folder = tmp_path_factory.mktemp("bench")
    lines = ["file\ttext"]
    for path, text in list(zip(speech_files, SENTENCES))[1:5]:
        (folder / path.name).write_bytes(path.read_bytes())
        lines.append(f"{path.name}\t{text}")
    manifest = folder.parent / "bench-manifest.tsv"
    manifest.write_text("\n".join(lines) + "\n")
    return folder, manifest


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asrserve", "bench", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_bench_sweep_saves_figures_and_plot(server, workload, tmp_path):
    folder, manifest = workload
    result_path = tmp_path / "result.json"
    run = bench(str(folder), "--manifest", str(manifest), "--url", server.url, "--api-key", API_KEY,
                "--sweep", "1,4", "-n", "8", "--save-result", str(result_path), "--no-progress")
    assert run.returncode == 0, run.stderr
    record = json.loads(result_path.read_text())
    assert record["model"] == "tiny.en" and record["files"] == 4
    assert [r["concurrency"] for r in record["runs"]] == [1, 4]
    for summary in record["runs"]:
        assert summary["requests"] == summary["succeeded"] == 8 and summary["failed"] == 0
        # Each of the 4 files twice: the audio counted is exactly twice the folder's.
        assert summary["audio_seconds"] == pytest.approx(2 * record["audio_seconds_per_pass"], rel=1e-3)
        assert summary["rtfx"] == pytest.approx(summary["audio_seconds"] / summary["wall_seconds"], rel=0.01)
        latency = summary["latency_ms"]
        assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
        assert latency["max"] <= 1000 * summary["wall_seconds"]
        assert summary["health"]["probes"] > 0 and summary["health"]["failures"] == 0
        assert 0 <= summary["wer"] < 0.5 and summary["wer_requests"] == 8
    # The table on stdout has a row per concurrency; the plot is a real PNG.
    rows = [line.split() for line in run.stdout.strip().splitlines()]
    assert rows[0][:4] == ["conc", "ok", "fail", "RTFx"] and [r[0] for r in rows[1:]] == ["1", "4"]
    plot = result_path.with_suffix(".png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(plot).shape[:2] == (480, 1200)  # 10 x 4 inches at 120 dpi


@pytest.mark.slow
def test_bench_streaming_reports_time_to_first_token(server, workload, tmp_path):
    folder, manifest = workload
    result_path = tmp_path / "stream.json"
    run = bench(str(folder), "--manifest", str(manifest), "--url", server.url, "--api-key", API_KEY,
                "--stream", "-c", "2", "-n", "4", "--save-result", str(result_path), "--no-progress")
    assert run.returncode == 0, run.stderr
    summary = json.loads(result_path.read_text())["runs"][0]
    assert summary["succeeded"] == 4
    ttft, latency = summary["ttft_ms"], summary["latency_ms"]
    assert 0 < ttft["p50"] <= ttft["p99"] <= latency["max"]
    assert summary["wer"] < 0.5  # the streamed text is the whole transcript
    assert "TTFT p50" in run.stdout


@pytest.mark.slow
def test_bench_counts_failures_and_exits_nonzero_when_all_fail(server, workload, tmp_path):
    folder, manifest = workload
    result_path = tmp_path / "fail.json"
    run = bench(str(folder), "--url", server.url, "--model", "tiny.en", "--api-key", "wrong",
                "-n", "3", "--warmup", "0", "--save-result", str(result_path), "--no-progress")
    assert run.returncode == 1
    summary = json.loads(result_path.read_text())["runs"][0]
    assert summary["failed"] == 3 and summary["failures_by_status"] == {"401": 3}
    assert "401" in summary["first_errors"][0]


@pytest.mark.slow
def test_bench_realtime_streams_alone_and_beside_uploads(server, workload, tmp_path):
    folder, manifest = workload
    two = tmp_path / "two.tsv"  # two short files keep the real-time playing short
    two.write_text("\n".join(manifest.read_text().splitlines()[:3]) + "\n")
    result_path = tmp_path / "live.json"
    run = bench(str(folder), "--manifest", str(two), "--url", server.url, "--api-key", API_KEY,
                "--realtime", "1", "--realtime-uploads", "2", "--realtime-gap-s", "1.0", "--save-result", str(result_path))
    assert run.returncode == 0, run.stderr
    (alone,) = json.loads(result_path.read_text())["runs"]
    beside = alone["with_uploads"]
    for live in (alone, beside):
        assert live["streams"] == 1 and live["utterances"] >= 2 and live["errors"] == []
        latency = live["end_of_speech_to_completed_ms"]
        assert 0 < latency["p50"] <= latency["p99"] <= latency["max"]
        if live["utterances_with_delta_before_completed"]:  # timed from the turn's own speech start
            first = live["time_to_first_delta_ms"]
            assert 0 < first["p50"] <= first["max"] < 30_000
        assert live["wer"] < 0.5
    uploads = beside["uploads"]
    assert uploads["concurrency"] == 2 and uploads["succeeded"] >= 2 and uploads["failed"] == 0
    assert uploads["rtfx"] > 0 and uploads["wer"] < 0.5
    ratio = beside["end_of_speech_to_completed_ms"]["p99"] / latency_p99(alone)
    assert alone["p99_slowdown_with_uploads"] == pytest.approx(ratio, abs=0.01)
    assert "most live streams with end of speech -> completed p99 under 1 s" in run.stdout
    assert "beside 2 uploading clients" in run.stderr


@pytest.mark.slow
def test_bench_names_the_fix_and_takes_the_openai_base_url(server, workload, tmp_path):
    """Without a key it said "pass --model"; given the "OpenAI base URL" the server prints
    (…/v1) it asked for …/v1/v1/models and said the same."""
    folder, _ = workload
    run = bench(str(folder), "--url", server.url, "-n", "1", "--no-progress")
    assert run.returncode == 2 and "401; pass --api-key" in run.stderr, run.stderr
    run = bench(str(folder), "--url", server.url + "/v1/", "--api-key", API_KEY, "-n", "1", "--warmup", "0",
                "--save-result", str(tmp_path / "r.json"), "--no-progress")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["succeeded"] == 1


def latency_p99(run: dict) -> float:
    return run["end_of_speech_to_completed_ms"]["p99"]


def test_bench_usage_errors():
    run = bench("/nonexistent-folder", "--url", "http://127.0.0.1:9")
    assert run.returncode == 2 and "is not a folder" in run.stderr
    run = bench(".", "--sweep", "1,x")
    assert run.returncode == 2 and "--sweep" in run.stderr
    run = bench(".", "--realtime-uploads", "2")
    assert run.returncode == 2 and "needs --realtime" in run.stderr
    run = bench(".", "--realtime", "0")
    assert run.returncode == 2 and "--realtime takes" in run.stderr
    # refused up front, where they failed every stream ("negative count") or request, or spun
    for flag, value in (("--realtime-gap-s", "-1"), ("--timeout", "0"), ("--health-interval", "0"), ("--warmup", "-1")):
        run = bench(".", flag, value, "--url", "http://127.0.0.1:9")
        assert run.returncode == 2 and f"{flag} must be" in run.stderr, (flag, run.stderr)


def test_manifest_names_files_in_subfolders(speech_files, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.wav").write_bytes(speech_files[1].read_bytes())
    manifest = tmp_path / "m.tsv"
    manifest.write_text(f"file\ttext\nsub/a.wav\t{SENTENCES[1]}\n")
    assert [(f.name, f.reference) for f in load_workload(tmp_path, manifest)] == [("a.wav", SENTENCES[1])]


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    """A server whose transcriptions are 200s of HTML, whose /health answers 503 after 0.3 s and
    which speaks no WebSocket."""

    def do_GET(self):
        if self.path == "/health":
            time.sleep(0.3)
            self._answer(503, b"{}")
        else:
            self._answer(200, b"<html>not a WebSocket</html>")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(200, b"<html>a proxy's page</html>")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_bench_reports_what_a_misbehaving_server_does(workload, tmp_path):
    """Unreadable 200s are failures (the run used to end in a traceback), failed /health probes
    count in its p99 for as long as they took, and live streams that cannot connect are errors
    of their level, saved (a traceback before, and no JSON)."""
    folder, manifest = workload
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        result_path = tmp_path / "bad.json"
        run = bench(str(folder), "--url", url, "--model", "m", "--duration", "1.5", "-c", "2", "--warmup", "0",
                    "--save-result", str(result_path), "--no-progress")
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        summary = json.loads(result_path.read_text())["runs"][0]
        assert summary["failed"] == summary["requests"] > 0 and "unreadable response" in summary["first_errors"][0]
        health = summary["health"]
        assert 1 <= health["failures"] == health["probes"] and health["p99"] >= 300
        live_path = tmp_path / "live.json"
        run = bench(str(folder), "--url", url, "--model", "m", "--realtime", "1", "--save-result", str(live_path))
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        (level,) = json.loads(live_path.read_text())["runs"]
        assert level["utterances"] == 0 and level["errors"]
    finally:
        server.shutdown()


@pytest.mark.slow
def test_bench_realtime_asks_for_the_model_given(server, workload, tmp_path):
    folder, manifest = workload
    result_path = tmp_path / "nosuch.json"
    run = bench(str(folder), "--url", server.url, "--api-key", API_KEY, "--model", "nosuch", "--realtime", "1",
                "--save-result", str(result_path))
    assert run.returncode == 1, run.stderr
    (level,) = json.loads(result_path.read_text())["runs"]
    assert level["utterances"] == 0 and "404" in level["errors"][0]


def test_bench_refuses_a_manifest_with_untexted_formats(workload):
    folder, manifest = workload
    run = bench(str(folder), "--manifest", str(manifest), "--response-format", "srt", "--url", "http://127.0.0.1:9")
    assert run.returncode == 2 and "gives none" in run.stderr
