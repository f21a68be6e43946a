"""Audio in, 16 kHz mono float32 out: decode, mix down, resample, validate."""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Callable, Union

import numpy as np
import soundfile
import soxr

from asrserve.config import SAMPLE_RATE

AudioSource = Union[str, Path, bytes, bytearray, BinaryIO, np.ndarray]  # or a torch tensor, as an array
# Called as a file is decoded with the 16 kHz samples so far (a view, valid for the call) and
# the duration its header declares (0 if it does not say).
ProgressCallback = Callable[[np.ndarray, float], None]


class AudioError(ValueError):
    """The audio cannot be transcribed: unreadable, empty or not finite. Safe to show users."""


class AudioTooLongError(AudioError):
    def __init__(self, duration_s: float, max_duration_s: float, exact=True, of_what: str = "", at_least=False):
        length = f"{'at least ' * at_least}{duration_s:.1f} s long" if exact else f"longer than {max_duration_s:g} s"
        super().__init__(f"audio is {length}; at most {max_duration_s:g} s{of_what} is accepted")
        self.duration_s = duration_s
        self.max_duration_s = max_duration_s


def load_audio(
    source: AudioSource, sample_rate: int | None = None, max_duration_s: float | None = None,
    on_progress: ProgressCallback | None = None,
) -> np.ndarray:
    """Decodes a file, its bytes, or an array into 16 kHz mono float32.

    An array is taken as samples at `sample_rate` (16 kHz when not given), shaped [samples],
    [samples, channels] or [channels, samples] (the longer side is time). With max_duration_s,
    longer audio raises AudioTooLongError as soon as that is known (before decoding where the
    container says how long it is), so a small compressed upload cannot expand into gigabytes
    of samples. on_progress (files only) sees the samples as they are decoded: an exception it
    raises stops the decoding.
    """
    if is_tensor(source):  # torchaudio.load's, on any device: an array of samples too
        tensor = source.detach().cpu()
        source = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
    if isinstance(source, np.ndarray):
        samples, rate = source, sample_rate or SAMPLE_RATE
        _check_duration(max(samples.shape[:2], default=0) / rate, max_duration_s)  # time is the longer side
        return to_model_input(samples, rate)
    try:
        # 16 kHz mono float32 already, and checked block by block (MonoResampler._append)
        return _decode(source, max_duration_s, _Progress(on_progress))
    except _ProgressFailed as failed:
        raise failed.error from None


def is_tensor(source) -> bool:  # (without importing torch; a tensor's `mode` is a method, not a file's mode)
    return type(source).__module__.split(".")[0] == "torch" and hasattr(source, "detach")


def to_model_input(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim == 2:
        if samples.shape[0] < samples.shape[1]:  # [channels, samples], as torchaudio and librosa give
            samples = samples.T
        samples = samples.mean(axis=1)  # mix every channel down to mono
    if samples.ndim != 1:
        raise AudioError(f"audio must be [samples] or [samples, channels], got shape {samples.shape}")
    if samples.size == 0:
        raise AudioError("audio is empty: it has no samples")
    if np.issubdtype(samples.dtype, np.unsignedinteger):
        # Unsigned PCM (8-bit WAV's): silence is mid-scale; full scale maps to [-1, 1)
        half = float(np.iinfo(samples.dtype).max // 2 + 1)
        samples = (samples.astype(np.float64) - half).astype(np.float32) / half
    elif np.issubdtype(samples.dtype, np.integer):
        # PCM integers: full scale maps to [-1, 1)
        samples = samples.astype(np.float32) / float(np.iinfo(samples.dtype).max + 1)
    elif not np.issubdtype(samples.dtype, np.floating):
        raise AudioError(f"audio samples must be numbers, got {samples.dtype}")
    samples = samples.astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise AudioError("audio contains NaN or infinite samples")
    if sample_rate != SAMPLE_RATE:
        samples = soxr.resample(samples, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)
    return np.ascontiguousarray(clip_to_full_scale(samples))  # after resampling, as files are


def clip_to_full_scale(samples: np.ndarray) -> np.ndarray:
    """Float audio past full scale clipped to [-1, 1], as ffmpeg's conversion to 16-bit PCM
    clips it for openai/whisper and faster-whisper: a float WAV of speech at 1000 times full
    scale read as silence (log-mel is not scale-free)."""
    if len(samples) and (samples.max() > 1.0 or samples.min() < -1.0):
        return np.clip(samples, -1.0, 1.0)
    return samples


# Sample rates a file may declare. Outside them a header is damaged or hostile (a rate of 1 Hz
# turns a few bytes into hours of audio to upsample).
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 768_000
# Decoding costs by the samples decoded, every channel's: past 8 channels at 48 kHz (7.1 film
# sound) the duration limit shrinks in proportion, so that a small FLAC of 8 channels at 384
# kHz (14 KB a minute, 2 s of a worker's time a minute) cannot hold a worker for minutes.
DECODE_BUDGET_RATE = 8 * 48_000
BLOCK_SAMPLES = 1 << 20  # decoded, mixed down and resampled this many samples (4 MB) at a time
MAX_PREALLOCATED_S = 4 * 3600  # the most audio a declared length reserves room for up front
UNKNOWN_FRAMES = 1 << 62  # libsndfile's frame counts from here up (SF_COUNT_MAX) mean "not known"


class MonoResampler:
    """Mixes blocks of [frames, channels] down to mono and resamples them to 16 kHz as they
    are decoded: memory stays that of the 16 kHz mono result, whatever the file's rate and
    channel count (a small FLAC of silence at 384 kHz x 8 channels would otherwise expand to
    gigabytes before the mix-down).

    The result is written into one buffer sized from the frame count the container declares
    (grown by doubling past it): joining the decoded blocks at the end held the audio twice,
    230 MB more for an hour. np.empty's pages take no memory until written, so a count that
    is too high costs nothing; one that is too low costs a copy."""

    def __init__(
        self, rate: int, max_duration_s: float | None, declared_frames: int = 0, on_progress: _Progress | None = None,
        declared_exact: bool = True, channels: int = 1, declared_at_least: bool = False,
    ):
        if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
            raise AudioError(f"audio has an unsupported sample rate of {rate} Hz")
        self.of_what = ""
        if max_duration_s is not None and rate * channels > DECODE_BUDGET_RATE:
            max_duration_s *= DECODE_BUDGET_RATE / (rate * channels)
            self.of_what = (f" of {channels} channels at {rate} Hz (past 384,000 samples a second, 8 channels at 48 kHz, "
                            "the limit shrinks in proportion)")
        # A declared length over the limit is refused before anything is decoded; an estimate
        # (declared_exact False: an MP3's or a bare AAC stream's) only sizes the buffer.
        if declared_exact and declared_frames > 0:
            _check_duration(declared_frames / rate, max_duration_s, self.of_what, at_least=declared_at_least)
        self.rate = rate
        self.max_duration_s = max_duration_s
        self.num_frames = 0
        self.stream = None if rate == SAMPLE_RATE else soxr.ResampleStream(rate, SAMPLE_RATE, 1, "float32", "HQ")
        # (a hostile header's count is held to the duration accepted, or to MAX_PREALLOCATED_S)
        declared_s = min(max(declared_frames, 0) / rate, max_duration_s or MAX_PREALLOCATED_S, MAX_PREALLOCATED_S)
        self.samples = np.empty(int(declared_s * SAMPLE_RATE) + SAMPLE_RATE, np.float32)
        self.length = 0
        self.declared_s = declared_s if declared_exact else 0.0  # what on_progress is told (0: unknown)
        self.on_progress = on_progress or _Progress(None)

    def add(self, block: np.ndarray, last: bool = False) -> None:
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf are refused after decoding
            mono = block.mean(axis=1, dtype=np.float32) if block.ndim == 2 else block
        mono = np.ascontiguousarray(mono, np.float32)
        self.num_frames += len(mono)
        if self.max_duration_s is not None and self.num_frames > self.max_duration_s * self.rate:
            raise AudioTooLongError(self.num_frames / self.rate, self.max_duration_s, exact=False, of_what=self.of_what)
        self._append(self.stream.resample_chunk(mono, last=last) if self.stream is not None else mono)

    def _append(self, values: np.ndarray) -> None:
        if not np.isfinite(values).all():  # refused before any of it is cut and sent on
            raise AudioError("audio contains NaN or infinite samples")
        values = clip_to_full_scale(values)
        end = self.length + len(values)
        if end > len(self.samples):
            grown = np.empty(max(end, 2 * len(self.samples)), np.float32)
            grown[: self.length] = self.samples[: self.length]
            self.samples = grown
        self.samples[self.length : end] = values
        self.length = end
        if len(values):
            self.on_progress(self.samples[: self.length], self.declared_s)

    def finish(self) -> np.ndarray:
        if self.stream is not None:
            self.add(np.zeros(0, np.float32), last=True)
        if self.num_frames == 0:
            raise AudioError("audio is empty: it has no samples")
        return self.samples[: self.length] if self.length else np.zeros(1, np.float32)  # (< 1 sample at 16 kHz)


class _ProgressFailed(Exception):
    """What on_progress raised, carried past the decoders' own error handling."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _Progress:
    def __init__(self, callback: ProgressCallback | None):
        self.callback = callback

    def __call__(self, samples: np.ndarray, declared_s: float) -> None:
        if self.callback is None:
            return
        try:
            self.callback(samples, declared_s)
        except Exception as error:
            raise _ProgressFailed(error) from error


def _decode(source: str | Path | bytes | bytearray | BinaryIO, max_duration_s: float | None, on_progress: _Progress) -> np.ndarray:
    """16 kHz mono float32 samples of a file."""
    if isinstance(source, (bytes, bytearray)):
        if len(source) == 0:
            raise AudioError("audio is empty: the file has no bytes")
        source = io.BytesIO(source)
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            raise AudioError(f"{source} is a folder, not an audio file")
        if not path.exists():
            raise AudioError(f"audio file not found: {source}")
        if not path.is_file() and not path.is_fifo():  # a device (/dev/zero would never end)
            raise AudioError(f"{source} is not a file or a pipe")
        if path.is_file() and path.stat().st_size == 0:
            raise AudioError(f"audio is empty: {source} has no bytes")
        # A pipe (the shell's <(...)) is read as a stream below; libsndfile and ffmpeg take
        # names as UTF-8, so a name in another encoding is opened here.
        if path.is_fifo() or not _is_utf8(str(path)):
            with open(path, "rb") as file:
                return _decode(file, max_duration_s, on_progress)
    elif isinstance(getattr(source, "mode", None), str) and "b" not in source.mode:
        raise AudioError("the file object was opened in text mode: open audio with mode 'rb'")
    elif not _seekable(source):  # a pipe, stdin, a response body: both decoders seek
        return _decode(source.read(), max_duration_s, on_progress)
    start = source.tell() if hasattr(source, "tell") else None
    try:
        return _decode_soundfile(source, max_duration_s, on_progress)
    except (soundfile.LibsndfileError, _NotForLibsndfile):
        # Containers libsndfile does not read (mp4/m4a, webm, aac, wma, ...): ffmpeg via PyAV.
        from asrserve.audio.ffmpeg_decode import decode_ffmpeg

        if start is not None:
            source.seek(start)
        return decode_ffmpeg(source, max_duration_s, on_progress)


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # bytes Python kept as surrogates (os.fsdecode)
        return False
    return True


def _seekable(source) -> bool:
    try:
        return source.seekable() if hasattr(source, "seekable") else hasattr(source, "seek")
    except (OSError, ValueError):
        return False


def _decode_soundfile(source, max_duration_s: float | None, on_progress: _Progress) -> np.ndarray:
    start = source.tell() if hasattr(source, "tell") else None
    try:
        with soundfile.SoundFile(source) as file:
            if file.format in ("MP3", "OGG"):
                # libsndfile stops an MP3 at its frame count, which is an estimate from the first
                # frame unless a Xing header gives it (a VBR file without one lost its last 75
                # s), and at the first damaged frame without an error; it reads an Ogg file's
                # first stream only, so of a chained one (Ogg files joined: a radio stream's
                # recording) the first file. ffmpeg reads both whole.
                raise _NotForLibsndfile
            if file.frames == 0:  # a header whose data size was never written (a recorder cut off): ffmpeg reads on
                raise _NotForLibsndfile
            # A FLAC of unknown length (STREAMINFO's total 0, as ffmpeg writes to a pipe) reports
            # SF_COUNT_MAX frames: unknown too, charged as it is read.
            declared = file.frames if file.frames < UNKNOWN_FRAMES else 0
            resampler = MonoResampler(file.samplerate, max_duration_s, declared, on_progress, channels=file.channels)
            block_frames = max(1, BLOCK_SAMPLES // max(1, file.channels))
            # Read until the decoder gives nothing more: a header's frame count may be wrong.
            while True:
                try:
                    block = file.read(block_frames, dtype="float32", always_2d=True)
                except soundfile.LibsndfileError:
                    if not resampler.num_frames:
                        raise  # not a file libsndfile reads after all: ffmpeg tries it
                    _read_up_to_the_damage(source, start, resampler, declared, file.channels)
                    break
                if not len(block):
                    break
                resampler.add(block)
            return resampler.finish()
    except (soundfile.LibsndfileError, AudioError, _NotForLibsndfile):
        raise
    except (RuntimeError, TypeError, ValueError) as error:
        raise AudioError(f"could not decode audio: {one_line(error)}") from None


class _NotForLibsndfile(Exception):
    """A format libsndfile opens but does not read as ffmpeg does: ffmpeg decodes it."""


SALVAGE_FRAMES = 4096
MAX_DAMAGE_SKIPPED = 64  # steps of SALVAGE_FRAMES: a damaged frame is skipped, a file cut off is not tried for long


def _read_up_to_the_damage(source, start: int | None, resampler: MonoResampler, declared: int, channels: int) -> None:
    """A file that breaks off after blocks were decoded keeps what it holds: the failed block is
    read again in small steps up to the damage, through a new handle (the failed one cannot
    seek). Starting again in ffmpeg would send the pieces already cut a second time. Where the
    header says more frames follow (`declared`), the damage may be a frame or two (a flipped
    bit in transit: the second half of a 213 s FLAC was lost): the frames from there that
    cannot be read become silence, as long as frames after them can, as ffmpeg skips a damaged
    frame. A truncated upload ("flac decoder lost sync") keeps what came."""
    while True:
        try:
            with _reopened(source, start, resampler.num_frames) as file:
                while len(block := file.read(SALVAGE_FRAMES, dtype="float32", always_2d=True)):
                    resampler.add(block)
                return  # read to the end
        except soundfile.LibsndfileError:
            pass
        # Unreadable at resampler.num_frames: is there a frame after it?
        for step in range(1, MAX_DAMAGE_SKIPPED + 1):
            position = resampler.num_frames + step * SALVAGE_FRAMES
            if position >= declared:
                return
            try:
                with _reopened(source, start, position) as file:
                    readable = len(file.read(SALVAGE_FRAMES, dtype="float32")) > 0
            except soundfile.LibsndfileError:
                readable = False
            if readable:
                resampler.add(np.zeros((position - resampler.num_frames, channels), np.float32))
                break
        else:
            return


def _reopened(source, start: int | None, frame: int) -> soundfile.SoundFile:
    """A new handle on `source` (from byte `start`), at `frame`."""
    if start is not None:
        source.seek(start)
    file = soundfile.SoundFile(source)
    try:
        file.seek(frame)
    except BaseException:
        file.close()
        raise
    return file


def _check_duration(duration_s: float, max_duration_s: float | None, of_what: str = "", at_least: bool = False) -> None:
    if max_duration_s is not None and duration_s > max_duration_s:
        raise AudioTooLongError(duration_s, max_duration_s, of_what=of_what, at_least=at_least)


def one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__
