"""The browser pages: GET / and the playground's files (no engine needed), then the playground
end to end in a real headless Chromium against `asrserve serve` on tiny.en: a file uploaded
through the page, and the fake microphone transcribed live through /v1/realtime."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import soundfile
import soxr
from fastapi.testclient import TestClient

from asrserve.config import EngineConfig, ServerConfig
from asrserve.entrypoints.api_server import build_app
from tests.browser import Browser, find_chromium
from tests.conftest import SENTENCES
from tests.server_utils import ServerProcess
from tests.wer import word_errors

API_KEY = "sk-playground"


def pages(**config) -> TestClient:
    return TestClient(build_app(ServerConfig(**config), EngineConfig()))  # no lifespan: no engine


def test_index_links_the_playground_and_the_playground_loads_only_its_own_files():
    client = pages(served_model_names=["tiny.en", "<b>"])
    index = client.get("/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert 'href="playground"' in index.text and "&lt;b&gt;" in index.text  # names are escaped
    # Every link, and everything the page loads or calls, is relative: behind a reverse proxy's
    # path prefix (/asr/playground) it stays under the prefix.
    assert re.findall(r'href="/', index.text) == []

    page = client.get("/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    referenced = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "playground/playground.js" in referenced
    for url in referenced:
        if url == "data:,":  # the empty icon
            continue
        assert not re.match(r"/|[a-z]+:", url), f"{url}: relative, and nothing from elsewhere"
        assert client.get(f"/{url}").status_code == 200, url  # as the browser resolves it from /playground
    script = client.get("/playground/playground.js").text
    assert '"playground/pcm-worklet.js"' in script and '"v1/realtime?intent=transcription"' in script
    assert '"v1/models"' in script and '"v1/audio/transcriptions"' in script
    assert re.findall(r"https?://", script) == [] and re.findall(r"""["'`]/""", script) == []
    assert client.get("/playground/pcm-worklet.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/playground/playground.css").headers["content-type"].startswith("text/css")

    # Both pages name an (empty) icon, so that no browser asks for /favicon.ico, a 404 in the log.
    assert '<link rel="icon" href="data:,">' in index.text and '<link rel="icon" href="data:,">' in page.text

    # With a slash, back to the page relatively: Starlette's redirect named /playground from the
    # root, out of a reverse proxy's prefix (/asr/playground/ -> /playground, a 404 there).
    slash = client.get("/playground/", follow_redirects=False)
    assert slash.status_code == 307 and slash.headers["location"] == "../playground"

    missing = client.get("/playground/missing.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert client.get("/playground/..%2Fserving_playground.py").status_code == 404


def test_the_playground_can_be_turned_off():
    client = pages(playground=False)
    assert client.get("/").status_code == 200 and "/playground" not in client.get("/").text
    assert client.get("/playground").status_code == 404
    assert client.get("/playground/playground.js").status_code == 404


# --- a real browser -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    executable = find_chromium()
    if executable is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return executable


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(["--api-key", API_KEY, "--dtype", "float32", "--realtime-interim-interval-s", "0.3"])
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(16_000 * seconds), np.float32)


def speech_wav(path, audio: np.ndarray) -> None:
    """16 kHz float audio as a 48 kHz 16-bit wav: what a microphone delivers."""
    soundfile.write(path, soxr.resample(audio, 16_000, 48_000), 48_000, subtype="PCM_16")


def open_playground(browser: Browser, server) -> None:
    browser.open(f"{server.url}/")
    browser.evaluate("document.querySelector('a[href=\"playground\"]').click()")  # the index links it
    browser.wait_for("location.pathname === '/playground' && document.readyState === 'complete'")
    browser.evaluate(f"""(() => {{ const key = document.getElementById('api-key');
        key.value = {API_KEY!r}; key.dispatchEvent(new Event('change')); }})()""")
    browser.wait_for("document.getElementById('server-status').textContent === 'ready'")


def close_enough(reference: str, shown: str, offline_text: str) -> bool:
    """At most a fifth of the reference's words (at least two) more wrong than the API's own
    transcription of the same audio (tiny.en misreads espeak-ng somewhat)."""
    expected, words = word_errors(reference, offline_text)
    errors, _ = word_errors(reference, shown)
    return errors <= expected + max(2, words // 5)


@pytest.mark.slow
def test_a_file_uploaded_in_the_playground_shows_its_transcript_segments_and_word_times(
    chromium, server, speech_audio, tmp_path
):
    path = tmp_path / "two sentences.wav"
    speech_wav(path, np.concatenate([speech_audio[1], silence(1.0), speech_audio[3]]))
    reference = f"{SENTENCES[1]} {SENTENCES[3]}"
    browser = Browser(chromium)
    try:
        open_playground(browser, server)
        # The page holds the API key: its policy lets it connect to this server alone, its
        # WebSocket included (the live test), not to another host's.
        elsewhere = f"ws://127.0.0.2:{server.port}/v1/realtime"
        assert browser.evaluate(f"""new Promise((resolve) => {{
            document.addEventListener('securitypolicyviolation', (e) => resolve(e.effectiveDirective));
            const socket = new WebSocket({elsewhere!r});
            socket.onopen = socket.onerror = () => setTimeout(() => resolve('not blocked'), 500);
        }})""") == "connect-src"
        browser.set_files("#file", path)
        browser.evaluate("document.getElementById('transcribe').click()")
        browser.wait_for("document.getElementById('upload-status').textContent.includes(' in ')", timeout=60)
        shown = browser.evaluate("""({
            text: document.getElementById('upload-text').textContent,
            segments: document.querySelectorAll('#segments tbody tr').length,
            words: [...document.querySelectorAll('#segments .word')].map((w) => [
                w.firstChild.textContent, Number(w.dataset.start), Number(w.dataset.end)]),
            status: document.getElementById('upload-status').textContent,
        })""")
    finally:
        browser.close()

    api = _transcribe(server, path)
    assert shown["text"] == api["text"], "the page shows what the API returned"
    assert close_enough(reference, shown["text"], api["text"]), shown
    assert shown["segments"] == len(api["segments"]) >= 1
    assert [word for word, _, _ in shown["words"]] == [w["word"].strip() for w in api["words"]]
    starts = [start for _, start, _ in shown["words"]]
    assert starts == sorted(starts) and all(0 <= s <= e <= api["duration"] + 0.01 for _, s, e in shown["words"])
    assert shown["status"].startswith(f"{api['duration']:.1f} s of {api['language']} in ")


@pytest.mark.slow
def test_the_playground_sends_its_task_and_prompt(chromium, server, speech_audio, tmp_path):
    path = tmp_path / "one sentence.wav"
    speech_wav(path, speech_audio[1])
    browser = Browser(chromium)
    try:
        open_playground(browser, server)
        browser.evaluate("""(() => { const send = window.fetch; window.sent = [];
            window.fetch = (url, options) => {  // what each upload asked for, its file aside
                if (options && options.body instanceof FormData)
                    window.sent.push([String(url), [...options.body.entries()].filter(([k]) => k !== 'file')]);
                return send(url, options); }; })()""")
        browser.set_files("#file", path)
        browser.evaluate("""(() => { document.getElementById('prompt').value = 'Harvard sentences.';
            document.getElementById('task').value = 'translate';
            document.getElementById('transcribe').click(); })()""")
        # tiny.en is English-only: the server's refusal is shown as it said it
        refused = browser.wait_for("""(() => { const s = document.getElementById('upload-status');
            return s.classList.contains('error') && s.textContent; })()""", timeout=60)
        browser.evaluate("""(() => { document.getElementById('task').value = 'transcribe';
            document.getElementById('transcribe').click(); })()""")
        browser.wait_for("document.getElementById('upload-status').textContent.includes(' in ')", timeout=60)
        sent = browser.evaluate("window.sent")
        # Live with a language tiny.en cannot read: the refused session.update ends the session
        # (it went on transcribing English without the language asked for, under the error).
        browser.evaluate("""(() => { document.getElementById('language').value = 'fr';
            document.getElementById('live').click(); })()""")
        browser.wait_for("""document.getElementById('live').textContent === 'Live'
            && document.getElementById('live-status').textContent.includes('English-only')""", timeout=60)
        # A key pasted with an invisible character is said to be one, not "server unreachable" retried for ever.
        browser.evaluate("""(() => { const key = document.getElementById('api-key');
            key.value = 'sk-playground\\u200b'; key.dispatchEvent(new Event('change'));
            document.getElementById('transcribe').click(); })()""")
        unsendable = browser.wait_for("""(() => { const s = document.getElementById('server-status').textContent,
            u = document.getElementById('upload-status').textContent;
            return s.includes('cannot carry') && u.includes('cannot carry') && s; })()""", timeout=30)
    finally:
        browser.close()
    assert "cannot translate" in refused and "unreachable" not in unsendable
    assert [url for url, _ in sent] == ["v1/audio/translations", "v1/audio/transcriptions"]
    assert all(["prompt", "Harvard sentences."] in fields for _, fields in sent), sent


def _transcribe(server, path) -> dict:
    with open(path, "rb") as f:
        response = httpx.post(
            f"{server.url}/v1/audio/transcriptions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
            files={"file": (path.name, f)},
            data={"response_format": "verbose_json", "timestamp_granularities[]": ["segment", "word"]},
        )
    response.raise_for_status()
    return response.json()


@pytest.mark.slow
def test_the_playground_transcribes_the_microphone_live(chromium, server, speech_audio, tmp_path):
    # two sentences tiny.en reads right from espeak-ng wherever they start and however resampled
    first, second = 5, 15
    audio = np.concatenate([silence(0.7), speech_audio[first], silence(1.5), speech_audio[second], silence(2.0)])
    path = tmp_path / "microphone.wav"
    speech_wav(path, audio)
    browser = Browser(chromium, microphone=path)
    try:
        open_playground(browser, server)
        browser.evaluate("document.getElementById('live').click()")
        browser.wait_for("document.getElementById('live-status').textContent === 'listening: speak'")
        # the fake microphone plays the file once at real time (about 14 s), then silence
        items = browser.wait_for("""(() => {
            const done = [...document.querySelectorAll('#live-items li.final')];
            return done.length >= 2 && done.map((item) => [item.querySelector('.text').textContent,
                Number(item.dataset.startMs), Number(item.dataset.endMs)]); })()""", timeout=60)
        browser.evaluate("document.getElementById('live').click()")  # Stop
        browser.wait_for("document.getElementById('live').textContent === 'Live'")
        status, failed, shown = browser.evaluate("""[document.getElementById('live-status').textContent,
            document.querySelectorAll('#live-items li.failed').length,
            document.querySelectorAll('#live-items li').length]""")
    finally:
        browser.close()

    assert len(items) == 2 and failed == 0 and status == "stopped", (items, status)
    # Stop between turns commits nothing: it committed the silence kept as prefix padding, a
    # third item reading "" or "you"
    assert shown == 2, shown
    for (text, start_ms, end_ms), index in zip(items, (first, second)):
        # the API's own transcription of the turn server VAD heard (as the browser's clock placed it)
        turn = tmp_path / f"turn{index}.wav"
        speech_wav(turn, audio[start_ms * 16 : end_ms * 16])
        assert close_enough(SENTENCES[index], text, _transcribe(server, turn)["text"]), (items, index)


@pytest.mark.slow
def test_live_without_server_vad_commits_what_was_said_on_stop(chromium, speech_audio, tmp_path):
    """Where the server cannot load Silero VAD a live session takes manual commits (the page's
    server_vad is refused): Stop commits what was said. Waiting for server VAD's turns, it
    committed nothing, and the words shown so far were lost."""
    import os
    import time

    shadow = tmp_path / "shadow" / "silero_vad"  # a package of that name without its weights, found first
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    pythonpath = os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")]))
    process = ServerProcess(["--api-key", API_KEY, "--dtype", "float32", "--realtime-interim-interval-s", "0.3"],
                            env={"PYTHONPATH": pythonpath})
    audio = np.concatenate([silence(0.5), speech_audio[5], silence(1.0)])
    path = tmp_path / "microphone.wav"
    speech_wav(path, audio)
    browser = Browser(chromium, microphone=path)
    try:
        process.wait_ready()
        open_playground(browser, process)
        browser.evaluate("document.getElementById('live').click()")
        browser.wait_for("/VAD/.test(document.getElementById('live-status').textContent)")  # says why
        time.sleep(len(audio) / 16_000 + 0.5)  # the fake microphone plays the file once
        browser.evaluate("document.getElementById('live').click()")  # Stop
        browser.wait_for("document.getElementById('live').textContent === 'Live'", timeout=60)
        shown = browser.evaluate("""[...document.querySelectorAll('#live-items li.final .text')]
            .map((text) => text.textContent)""")
    finally:
        browser.close()
        process.stop()
    assert len(shown) == 1 and close_enough(SENTENCES[5], shown[0], SENTENCES[5]), shown


@pytest.mark.slow
def test_live_on_a_plain_http_page_not_on_localhost_says_it_needs_https(chromium, server):
    """Browsers give no microphone to plain-http pages other than localhost's (the page served
    from a machine's name or address): the page says so, and opens no live session."""
    host = "asrserve.test"  # a name that is not localhost, resolved to it by Chromium itself
    browser = Browser(chromium, extra_args=(f"--host-resolver-rules=MAP {host} 127.0.0.1",))
    try:
        browser.open(f"http://{host}:{server.port}/playground")
        browser.wait_for("document.readyState === 'complete'")
        assert browser.evaluate("window.isSecureContext") is False
        browser.evaluate("document.getElementById('live').click()")
        status = browser.wait_for("""(() => { const s = document.getElementById('live-status');
            return s.classList.contains('error') && s.textContent; })()""")
        button = browser.evaluate("document.getElementById('live').textContent")
    finally:
        browser.close()
    assert "https" in status and "localhost" in status, status
    assert button == "Live", button  # not left waiting on a session that never opened


@pytest.mark.slow
def test_the_live_capture_filters_what_it_cannot_resample_where_the_browser_captures_at_48_khz(chromium, server):
    """Browsers that cannot open the microphone at 24 kHz capture at its own rate and the
    worklet resamples. A tone above 12 kHz (at 20 kHz, a hiss) then folded down to 4 kHz at
    full strength; a low-pass ahead of the worklet keeps speech and removes it."""
    browser = Browser(chromium)
    try:
        browser.open(f"{server.url}/playground")
        browser.wait_for("document.readyState === 'complete'")
        rms_of = """(async (frequency) => {
            const context = new OfflineAudioContext(1, 48000, 48000);
            const tone = new OscillatorNode(context, { frequency });
            const gain = new GainNode(context, { gain: 0.5 });
            tone.connect(gain);
            const chunks = [];
            await connectCapture(context, gain, (chunk) => chunks.push(new Int16Array(chunk)));
            tone.start();
            await context.startRendering();
            await new Promise((resolve) => setTimeout(resolve, 300));  // the worklet's last messages
            const samples = chunks.slice(1).flatMap((chunk) => [...chunk]);  // after the filter settles
            const power = samples.reduce((sum, value) => sum + (value / 32767) ** 2, 0) / samples.length;
            return [chunks.length, chunks[0].length, Math.sqrt(power)];
        })"""
        speech_band = browser.evaluate(f"{rms_of}(1000)")
        above = browser.evaluate(f"{rms_of}(20000)")
    finally:
        browser.close()
    assert speech_band[:2] == [10, 2400], speech_band  # 100 ms chunks of 24 kHz
    assert abs(speech_band[2] - 0.5 / 2**0.5) < 0.02, speech_band
    assert above[2] < 0.01, above  # at least 37 dB down; folded whole, it was 0.35
