"""Sends transcription requests to a running server at a fixed concurrency and times them,
while a probe times /health."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from asrserve.benchmark.workload import AudioFile


@dataclass(frozen=True)
class LoadSpec:
    url: str  # the server's root, e.g. http://127.0.0.1:8000
    model: str
    concurrency: int
    num_requests: int | None = None  # stop after this many ...
    duration_s: float | None = None  # ... or stop starting new ones after this long
    stream: bool = False
    endpoint: str = "transcriptions"  # or "translations"
    language: str | None = None
    response_format: str = "json"
    api_key: str | None = None
    fields: tuple[tuple[str, str], ...] = ()  # more form fields, sent as given
    timeout_s: float = 600.0
    health_interval_s: float = 0.05
    progress: bool = True


@dataclass
class RequestSample:
    file_index: int
    start: float
    end: float
    status: int  # HTTP status; 0 when the connection failed
    first_token: float | None = None  # streaming: when the first text delta arrived
    text: str | None = None
    error: str | None = None


@dataclass
class LoadResult:
    spec: LoadSpec
    wall_s: float
    samples: list[RequestSample]
    health_latencies_s: list[float] = field(default_factory=list)
    health_failures: int = 0


async def run_load(spec: LoadSpec, files: list[AudioFile]) -> LoadResult:
    """`spec.concurrency` workers each send one request at a time, taking the files in turn,
    until `num_requests` have been sent or `duration_s` has passed."""
    if spec.num_requests is None and spec.duration_s is None:
        raise ValueError("give a number of requests or a duration")
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    # One client, with one connection, per worker. A shared pool of `concurrency` connections
    # checks every one of them (a poll of its socket) on each request: at 256 in flight that
    # was most of the client's CPU, and the client, not the server, set the throughput
    # measured against a GPU server (uploads crawled in at ~35 MB/s).
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    timeout = httpx.Timeout(spec.timeout_s, connect=30.0)
    tls = ssl.create_default_context()  # made once: loading the CA bundle takes ~25 ms a client
    next_index = itertools.count()
    samples: list[RequestSample] = []
    result = LoadResult(spec, 0.0, samples)
    bar = tqdm(total=spec.num_requests, unit="req", disable=not spec.progress, leave=False,
               desc=f"concurrency {spec.concurrency}", mininterval=0.5)

    started = time.perf_counter()

    def more() -> int | None:
        index = next(next_index)
        if spec.num_requests is not None and index >= spec.num_requests:
            return None
        if spec.duration_s is not None and time.perf_counter() - started >= spec.duration_s:
            return None
        return index

    async def worker() -> None:
        async with httpx.AsyncClient(
            base_url=spec.url, headers=headers, timeout=timeout, limits=limits, verify=tls
        ) as client:
            while (index := more()) is not None:
                sample = await _send(client, spec, files, index % len(files))
                samples.append(sample)
                bar.update(1)
                if sample.error:
                    bar.set_postfix(failed=sum(1 for s in samples if s.error), refresh=False)

    probe = asyncio.create_task(_probe_health(spec, result))
    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    result.wall_s = time.perf_counter() - started
    probe.cancel()
    await asyncio.gather(probe, return_exceptions=True)
    bar.close()
    return result


async def _send(client: httpx.AsyncClient, spec: LoadSpec, files: list[AudioFile], file_index: int) -> RequestSample:
    audio = files[file_index]
    form: dict[str, str | list[str]] = {"model": spec.model, "response_format": spec.response_format}
    for name, value in spec.fields:  # a name given twice is sent twice (timestamp_granularities[])
        previous = form.get(name)
        form[name] = value if previous is None else [*([previous] if isinstance(previous, str) else previous), value]
    if spec.language and spec.endpoint == "transcriptions":
        form["language"] = spec.language
    if spec.stream:
        form["stream"] = "true"
    upload = {"file": (audio.name, audio.data, audio.mime_type)}
    sample = RequestSample(file_index, time.perf_counter(), 0.0, 0)
    try:
        request = client.build_request("POST", f"/v1/audio/{spec.endpoint}", data=form, files=upload)
        response = await client.send(request, stream=True)
        try:
            sample.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                sample.error = f"HTTP {response.status_code}: {_error_message(body)}"
            elif spec.stream:
                await _read_events(response, sample)
            else:
                sample.text = _text_of(spec.response_format, (await response.aread()).decode("utf-8"))
        finally:
            await response.aclose()
    except httpx.HTTPError as error:
        sample.error = f"{type(error).__name__}: {error}"
    except (ValueError, AttributeError) as error:  # a 200 whose body is not what the format promises
        sample.error = f"unreadable response: {type(error).__name__}: {str(error)[:120]}"
        sample.text = None
    sample.end = time.perf_counter()
    return sample


async def _read_events(response: httpx.Response, sample: RequestSample) -> None:
    """OpenAI's transcription stream: transcript.text.delta events, then transcript.text.done."""
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if event.get("type") == "transcript.text.delta" and event.get("delta") and sample.first_token is None:
            sample.first_token = time.perf_counter()
        elif event.get("type") == "transcript.text.done":
            sample.text = event.get("text", "")
        elif "error" in event:
            sample.error = f"stream error: {_error_message(line[len('data: '):])}"
    if sample.text is None and sample.error is None:
        sample.error = "the stream ended without transcript.text.done"


def _text_of(response_format: str, body: str) -> str | None:
    if response_format in ("json", "verbose_json"):
        return json.loads(body).get("text", "")
    if response_format == "text":
        return body
    return None  # srt/vtt: timed, but no text to score


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200]


async def _probe_health(spec: LoadSpec, result: LoadResult) -> None:
    """GET /health every `health_interval_s` on its own connection, for as long as the load runs."""
    async with httpx.AsyncClient(base_url=spec.url, timeout=10.0) as probe:
        while True:
            begin = time.perf_counter()
            try:
                response = await probe.get("/health")
                if response.status_code != 200:
                    result.health_failures += 1
            except httpx.HTTPError:
                result.health_failures += 1
            # Failed probes count too, for as long as they took (a probe that timed out after
            # 10 s is a /health that did not answer for 10 s): a load balancer waits as long.
            result.health_latencies_s.append(time.perf_counter() - begin)
            await asyncio.sleep(spec.health_interval_s)
