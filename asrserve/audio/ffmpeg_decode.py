"""Audio that libsndfile does not read (or not as ffmpeg does: MP3), decoded by ffmpeg through
PyAV, frame by frame into asrserve.audio.decode's MonoResampler."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Callable

import numpy as np

from asrserve.audio.decode import BLOCK_SAMPLES, AudioError, MonoResampler, one_line

ESTIMATED_LENGTH_FORMATS = {"aac", "mp3"}  # ffmpeg's demuxers of bare ADTS AAC and MP3 streams
# Of Ogg files joined (a chained stream), ffmpeg declares one file's length (the last's): enough
# to refuse a file, but the whole may be longer.
FIRST_LINK_LENGTH_FORMATS = {"ogg"}
# Demuxers ffmpeg may not pick for an upload, whatever its bytes look like: those that open the
# files or addresses the bytes name (a concat script, HLS, DASH and IMF playlists, an image
# sequence, SDP's network streams; AviSynth and VapourSynth run scripts; devices, which no
# probe picks, for good measure). An uploaded concat script "file a.ts" read a.ts from the
# server's working directory, and the errors told a client which files exist there. Nor may a
# demuxer open anything by protocol: an upload is read from memory, a local path as a file.
REFUSED_DEMUXERS = frozenset({
    "concat", "hls", "applehttp", "dash", "imf", "webm_dash_manifest", "image2", "image2pipe", "sdp", "rtsp",
    "rtp", "sap", "avisynth", "vapoursynth", "lavfi", "ffmetadata", "video4linux2", "v4l2", "alsa", "oss", "pulse",
    "fbdev", "x11grab", "xcbgrab", "kmsgrab", "jack", "openal", "sndio", "dv1394", "iec61883", "decklink",
})


def decode_ffmpeg(source, max_duration_s: float | None, on_progress: Callable[[np.ndarray, float], None]) -> np.ndarray:
    """16 kHz mono float32 samples of a file ffmpeg reads (on_progress: see decode.MonoResampler)."""
    import av

    is_path = isinstance(source, (str, Path))
    options = {"format_whitelist": _allowed_demuxers(), "protocol_whitelist": "file" if is_path else "none"}
    try:
        container = av.open(str(source) if is_path else source, mode="r", container_options=options)
    except av.ArgumentError:  # what ffmpeg answers for a demuxer that is not on the list
        raise AudioError("could not decode audio: not an audio or video file asrserve reads (playlists, "
                         "concat scripts and image sequences are refused)") from None
    except (av.FFmpegError, ValueError, UnicodeDecodeError) as error:
        raise _unreadable(error) from None
    try:
        with container:
            if not container.streams.audio:
                raise AudioError("could not decode audio: the file has no audio stream")
            stream = container.streams.audio[0]
            # A damaged header can leave the stream without a rate (PyAV then has no attribute).
            rate = getattr(stream, "sample_rate", None) or getattr(stream.codec_context, "sample_rate", 0)
            # Microseconds, when the container says. Raw ADTS AAC and MP3 streams carry no length:
            # ffmpeg estimates one from the first frames' bitrate (968 s for 30 s of VBR AAC).
            exact = container.format.name not in ESTIMATED_LENGTH_FORMATS
            if not rate:  # a codec ffmpeg does not know, or a header too damaged to say
                raise AudioError("could not decode audio: an unknown or damaged codec (the stream has no sample rate)")
            mono = MonoResampler(rate, max_duration_s, (container.duration or 0) * rate // 1_000_000, on_progress,
                                 exact, channels=stream.layout.nb_channels,
                                 declared_at_least=container.format.name in FIRST_LINK_LENGTH_FORMATS)
            # Float samples at the stream's own rate and channel layout, mixed down and resampled
            # to 16 kHz block by block. Frames in planar float are read as they are; any other
            # goes through a converter to interleaved float. A frame whose format, layout or rate
            # differs from the ones before (a damaged MP3 frame read as another kind) gets a
            # converter of its own, to the same output.
            # The layout at open: PyAV's stream.layout follows the decoder, whose layout changes
            # with a file's frames (MP3s joined from mono and stereo ones).
            layout = stream.layout
            blocks = _Blocks(mono, layout.nb_channels)
            converter, source_format = None, None
            for frame in _decoded_frames(container, stream):
                samples = _planar_float(frame, blocks.channels) if frame.sample_rate == rate else None
                if converter is not None and (samples is not None or _format(frame) != source_format):
                    blocks.add(converter.resample(None))  # what it holds goes first, in order
                    converter = None
                if samples is not None:
                    blocks.add_samples(samples)
                    continue
                if converter is None:
                    converter = av.AudioResampler(format="flt", layout=layout.name, rate=rate)
                    source_format = _format(frame)
                blocks.add(converter.resample(frame))
            if converter is not None:
                blocks.add(converter.resample(None))
            blocks.flush()
            return mono.finish()
    except AudioError:
        raise
    except (av.FFmpegError, ValueError, IndexError, UnicodeDecodeError) as error:
        raise _unreadable(error) from None


@cache
def _allowed_demuxers() -> str:
    """Every format this ffmpeg has but the refused ones, as ffmpeg's format_whitelist takes them
    (a demuxer of several names, "mov,mp4,m4a,...", is refused if any of them is)."""
    import av

    allowed = (name for name in av.formats_available if not REFUSED_DEMUXERS & set(name.split(",")))
    return ",".join(sorted(allowed))


def _unreadable(error: Exception) -> AudioError:
    # ffmpeg's own words ("Invalid data found when processing input"), without PyAV's errno and
    # '<none>' file name around them.
    reason = getattr(error, "strerror", None) or one_line(error)
    return AudioError(f"could not decode audio: not a format libsndfile or ffmpeg reads ({reason})")


class _Blocks:
    """Gathers decoded frames (an MP3 frame is 1152 samples) into blocks of about
    BLOCK_SAMPLES before they are mixed down and resampled: frame by frame, that work cost 3×
    what libsndfile takes for a whole MP3."""

    def __init__(self, mono: MonoResampler, channels: int):
        self.mono = mono
        self.channels = channels
        self.pending: list[np.ndarray] = []  # [samples, channels] each
        self.size = 0

    def add(self, frames) -> None:
        for frame in frames:
            self.add_samples(frame.to_ndarray().reshape(-1, self.channels))  # interleaved float

    def add_samples(self, samples: np.ndarray) -> None:
        self.pending.append(samples)
        self.size += samples.size
        if self.size >= BLOCK_SAMPLES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.mono.add(np.concatenate(self.pending))
            self.pending, self.size = [], 0


def _format(frame) -> tuple:
    return frame.format.name, frame.layout.name, frame.sample_rate


def _planar_float(frame, channels: int) -> np.ndarray | None:
    """A frame already in planar float32 (what ffmpeg's MP3, AAC, Opus and Vorbis decoders give),
    read from its planes without a conversion: [samples, channels]. Plane by plane, as many as
    the layout has channels (PyAV's to_ndarray read a ninth plane of 7.1 audio and crashed)."""
    if frame.format.name != "fltp" or frame.layout.nb_channels != channels:
        return None
    planes = [np.frombuffer(frame.planes[c], np.float32, frame.samples) for c in range(channels)]
    return np.stack(planes, axis=1)


def _decoded_frames(container, stream):
    """The stream's frames, packet by packet. A packet that fails to decode (a file cut off
    mid-frame, a damaged frame, the first ones included) is skipped, as the ffmpeg command
    skips it, and a demuxer error after the first frames ends the stream; if no packet decodes,
    the file is not audio ffmpeg reads."""
    import av

    decoded_any, first_error = False, None
    packets = container.demux(stream)
    while True:
        try:
            packet = next(packets)
        except StopIteration:
            break
        except av.FFmpegError:
            if not decoded_any:
                raise
            # The demuxer gave up past the first frames (Ogg files of two codecs joined): what
            # came is kept, as a file cut off keeps it.
            break
        try:
            frames = packet.decode()
        except av.FFmpegError as error:  # InvalidDataError mostly; a damaged AAC frame also gave EPERM
            first_error = first_error or error
            continue
        for frame in frames:
            decoded_any = True
            yield frame
    if not decoded_any and first_error is not None:
        raise first_error
