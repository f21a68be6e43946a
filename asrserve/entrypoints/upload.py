"""Reads a multipart/form-data upload as it streams in, refusing it (413) the moment the file
passes the size limit: an oversized upload is never held in memory, nor spooled to disk."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.requests import ClientDisconnect, Request

from asrserve.entrypoints.protocol import APIError
from asrserve.errors import shown

MAX_FIELD_BYTES = 64 * 1024  # a prompt or language is tiny; anything bigger is not a form field
MAX_FIELDS = 64
FORM_OVERHEAD_BYTES = 256 * 1024  # the fields and part headers around the file


@dataclass
class UploadedForm:
    fields: dict[str, list[str]] = field(default_factory=dict)
    file: bytes | bytearray | None = None
    filename: str | None = None


class ClientGone(Exception):
    """The client disconnected before the upload ended."""


async def read_form(
    request: Request, max_file_bytes: int, idle_timeout_s: float | None = None, file_field: str = "file",
    min_rate_bytes_s: float = 0.0, text_fields: Collection[str] = (),
) -> UploadedForm:
    """The form, its file read whole; idle_timeout_s: the longest wait for the next chunk
    (an upload that stalls gets 408 instead of holding its slot and its bytes forever);
    min_rate_bytes_s: the least an upload must bring a second, over each idle_timeout_s (one
    that trickles a byte at a time gets 408 too: 128 of them held every waiting slot, and every
    other client got 429). text_fields: the fields read as text even when sent as a file part
    (curl -F prompt=@prompt.txt): dropped, the request would run without them, without a word."""
    content_type, options = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or b"boundary" not in options:
        raise APIError(400, "the request body must be multipart/form-data with a file field", param=file_field)
    limit_mb = max_file_bytes / (1024 * 1024)
    too_large = APIError(
        413, f"the audio file is larger than the {limit_mb:g} MB limit", param=file_field, code="file_too_large"
    )
    spread_file = re.compile(rf"{re.escape(file_field)}\[\d+\]")  # file[0], file[1], ...: a byte array
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_file_bytes + FORM_OVERHEAD_BYTES:
        raise too_large  # refuse before reading a byte

    form = UploadedForm()
    part = _Part()
    file_data = bytearray()

    def on_part_begin() -> None:
        part.reset()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part.header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        part.header_value += data[start:end]

    def on_header_end() -> None:
        if part.header_name.lower() == b"content-disposition":
            _, params = parse_options_header(bytes(part.header_value))
            part.name = params.get(b"name", b"").decode("utf-8", "replace")
            filename = params.get(b"filename")
            part.filename = filename.decode("utf-8", "replace") if filename is not None else None
            part.ignored = part.filename is not None and part.name != file_field and (
                part.name.removesuffix("[]") not in text_fields)
        part.header_name, part.header_value = bytearray(), bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part.name == file_field:  # the audio, sent as a file or (curl -F 'file=<a.wav') a field
            if len(file_data) + (end - start) > max_file_bytes:
                raise too_large
            file_data.extend(data[start:end])
            return
        if part.ignored:
            return  # some other file: ignored, its bytes counted against the body limit below
        part.data += data[start:end]
        if len(part.data) > MAX_FIELD_BYTES:
            message = f"form field {shown(part.name)} is longer than {MAX_FIELD_BYTES} bytes"
            raise APIError(400, message, param=part.name[:64])

    def on_part_end() -> None:
        if part.name == file_field:
            if form.filename is not None:
                raise APIError(400, "send one audio file per request", param=file_field)
            form.filename = part.filename or "audio"  # only ever a label: never a path
            return
        if part.ignored:
            return
        if form.filename is None and spread_file.fullmatch(part.name):
            # A client that spreads a byte array over fields: OpenAI's Node SDK given a Buffer
            # sends file[0], file[1], ... (the form would run out of fields at the 65th byte).
            raise APIError(400, f"{file_field!r} arrived as one form field per byte ({file_field}[0], "
                           f"{file_field}[1], ...): send the audio as a file part (OpenAI's Node SDK: "
                           f"toFile(buffer, 'audio.wav'))", param=file_field)
        if len(form.fields) >= MAX_FIELDS and part.name not in form.fields:
            raise APIError(400, f"the form has more than {MAX_FIELDS} fields")
        form.fields.setdefault(part.name, []).append(part.data.decode("utf-8", "replace"))

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    received = 0
    try:
        parser = MultipartParser(options[b"boundary"], callbacks)  # (a boundary over 256 bytes raises)
        async for chunk in _chunks(request, idle_timeout_s, min_rate_bytes_s):
            received += len(chunk)
            if received > max_file_bytes + FORM_OVERHEAD_BYTES:
                raise too_large
            parser.write(chunk)
        parser.finalize()
        if parser.state is not MultipartState.END:
            # A body cut short (a broken client or proxy, a short Content-Length): its last part,
            # unterminated, would be dropped without a word (a response_format, or the audio).
            raise FormParserError("it ends before its closing boundary")
    except FormParserError as error:
        raise APIError(400, f"malformed multipart/form-data body: {error}") from None
    except ClientDisconnect:
        raise ClientGone() from None
    if form.filename is None:
        # (OpenAI's Node SDK leaves out a Blob without a name, fs.openAsBlob's among them.)
        raise APIError(400, f"the form has no {file_field!r} file: attach the audio as {file_field} (from "
                       f"OpenAI's Node SDK: a File, or toFile(data, 'audio.wav'))", param=file_field)
    form.file = file_data  # no copy: the decoder reads a bytearray as it is
    return form


async def _chunks(request: Request, idle_timeout_s: float | None, min_rate_bytes_s: float = 0.0):
    chunks = request.stream().__aiter__()
    # The rate is checked over windows of idle_timeout_s, not since the start: a fast start
    # followed by a trickle does not buy minutes.
    window_start, window_bytes = time.monotonic(), 0
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), idle_timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise APIError(
                408, f"the upload stalled: nothing arrived for {idle_timeout_s:g} s", code="upload_timeout",
                headers={"Connection": "close"},
            ) from None
        window_bytes += len(chunk)
        elapsed = time.monotonic() - window_start
        if min_rate_bytes_s and idle_timeout_s and elapsed >= idle_timeout_s:
            if window_bytes < min_rate_bytes_s * elapsed:
                raise APIError(
                    408, f"the upload is too slow: {window_bytes / elapsed / 1000:.1f} kB/s over {elapsed:.0f} s, "
                    f"under the server's {min_rate_bytes_s / 1000:g} kB/s", code="upload_timeout",
                    headers={"Connection": "close"},
                )
            window_start, window_bytes = time.monotonic(), 0
        yield chunk


class _Part:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.name = ""
        self.filename: str | None = None
        self.ignored = False  # a file part that is neither the audio nor one of the text fields
        self.header_name = bytearray()
        self.header_value = bytearray()
        self.data = bytearray()
