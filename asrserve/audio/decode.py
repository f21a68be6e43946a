"""Audio in, 16 kHz mono float32 out: decode, mix down, resample, validate."""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import soundfile
import soxr

from asrserve.config import SAMPLE_RATE

AudioSource = Union[str, Path, bytes, bytearray, BinaryIO, np.ndarray]


class AudioError(ValueError):
    """The audio cannot be transcribed: unreadable, empty or not finite. Safe to show users."""


class AudioTooLongError(AudioError):
    def __init__(self, duration_s: float, max_duration_s: float, exact: bool = True):
        length = f"{duration_s:.1f} s long" if exact else f"longer than {max_duration_s:g} s"
        super().__init__(f"audio is {length}; at most {max_duration_s:g} s is accepted")
        self.duration_s = duration_s
        self.max_duration_s = max_duration_s


def load_audio(source: AudioSource, sample_rate: int | None = None, max_duration_s: float | None = None) -> np.ndarray:
    """Decodes a file, its bytes, or an array into 16 kHz mono float32.

    An array is taken as samples at `sample_rate` (16 kHz when not given), shaped [samples]
    or [samples, channels]. With max_duration_s, longer audio raises AudioTooLongError as soon
    as that is known (before decoding where the container says how long it is), so a small
    compressed upload cannot expand into gigabytes of samples.
    """
    if isinstance(source, np.ndarray):
        samples, rate = source, sample_rate or SAMPLE_RATE
        _check_duration(len(samples) / rate, max_duration_s)
    else:
        samples, rate = _decode(source, max_duration_s)
    return to_model_input(samples, rate)


def to_model_input(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)  # mix every channel down to mono
    if samples.ndim != 1:
        raise AudioError(f"audio must be [samples] or [samples, channels], got shape {samples.shape}")
    if samples.size == 0:
        raise AudioError("audio is empty: it has no samples")
    if np.issubdtype(samples.dtype, np.integer):
        # PCM integers: full scale maps to [-1, 1)
        samples = samples.astype(np.float32) / float(np.iinfo(samples.dtype).max + 1)
    elif not np.issubdtype(samples.dtype, np.floating):
        raise AudioError(f"audio samples must be numbers, got {samples.dtype}")
    samples = samples.astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise AudioError("audio contains NaN or infinite samples")
    if sample_rate != SAMPLE_RATE:
        samples = soxr.resample(samples, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)
    return np.ascontiguousarray(samples)


def _decode(source: str | Path | bytes | bytearray | BinaryIO, max_duration_s: float | None) -> tuple[np.ndarray, int]:
    if isinstance(source, (bytes, bytearray)):
        if len(source) == 0:
            raise AudioError("audio is empty: the file has no bytes")
        source = io.BytesIO(source)
    elif isinstance(source, (str, Path)) and not Path(source).is_file():
        raise AudioError(f"audio file not found: {source}")
    start = source.tell() if hasattr(source, "tell") else None
    try:
        samples, rate = _decode_soundfile(source, max_duration_s)
    except soundfile.LibsndfileError:
        # Containers libsndfile does not read (mp4/m4a, webm, aac, wma, ...): ffmpeg via PyAV.
        if start is not None:
            source.seek(start)
        samples, rate = _decode_ffmpeg(source, max_duration_s)
    if rate <= 0:
        raise AudioError(f"audio has an invalid sample rate {rate}")
    return samples, rate


def _decode_soundfile(source, max_duration_s: float | None) -> tuple[np.ndarray, int]:
    try:
        with soundfile.SoundFile(source) as file:
            if file.samplerate > 0 and file.frames > 0:
                _check_duration(file.frames / file.samplerate, max_duration_s)
            samples = file.read(dtype="float32", always_2d=True)
            rate = file.samplerate
    except (soundfile.LibsndfileError, AudioError):
        raise
    except (RuntimeError, TypeError, ValueError) as error:
        raise AudioError(f"could not decode audio: {_one_line(error)}") from None
    return samples, rate


def _decode_ffmpeg(source, max_duration_s: float | None) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(source if not isinstance(source, Path) else str(source), mode="r") as container:
            if not container.streams.audio:
                raise AudioError("could not decode audio: the file has no audio stream")
            stream = container.streams.audio[0]
            rate = stream.sample_rate or stream.codec_context.sample_rate
            if container.duration:  # microseconds, when the container says
                _check_duration(container.duration / 1e6, max_duration_s)
            # Planar float at the stream's own rate and channel layout; we mix and resample.
            resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            chunks, num_samples = [], 0
            for frame in _decoded_frames(container, stream):
                for converted in resampler.resample(frame):
                    chunk = converted.to_ndarray()  # [channels, samples]
                    chunks.append(chunk)
                    num_samples += chunk.shape[1]
                if max_duration_s is not None and num_samples > max_duration_s * rate:
                    raise AudioTooLongError(num_samples / rate, max_duration_s, exact=False)
            for converted in resampler.resample(None):
                chunks.append(converted.to_ndarray())
    except AudioError:
        raise
    except (av.FFmpegError, ValueError, IndexError, UnicodeDecodeError) as error:
        message = f"could not decode audio: not a format libsndfile or ffmpeg reads ({_one_line(error)})"
        raise AudioError(message) from None
    if not chunks:
        raise AudioError("audio is empty: it has no samples")
    return np.concatenate(chunks, axis=1).T, rate


def _decoded_frames(container, stream):
    """The stream's frames, packet by packet. A packet that fails to decode (a file cut off
    mid-frame, a damaged frame) is skipped, as the ffmpeg command does, once earlier packets
    have decoded; if the first packets fail too, the file is not audio ffmpeg reads."""
    import av

    decoded_any = False
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.error.InvalidDataError:
            if not decoded_any:
                raise
            continue
        for frame in frames:
            decoded_any = True
            yield frame


def _check_duration(duration_s: float, max_duration_s: float | None) -> None:
    if max_duration_s is not None and duration_s > max_duration_s:
        raise AudioTooLongError(duration_s, max_duration_s)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__
