"""Decoding to 16 kHz mono, bad input, chunking at quiet points, log-mel features."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch

from asrserve.audio.chunking import split_audio
from asrserve.audio.decode import AudioError, AudioTooLongError, load_audio
from asrserve.audio.features import LogMelSpectrogram
from asrserve.config import SAMPLE_RATE
from tests.conftest import require_ffmpeg

SR = 16000


def tone(seconds: float, rate: int, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


@pytest.mark.parametrize(
    ("fmt", "subtype"),
    [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III")],
)
def test_formats_libsndfile_reads(tmp_path, fmt, subtype):
    path = tmp_path / f"clip.{fmt.lower()}"
    rate = 48000 if subtype == "OPUS" else 22050
    soundfile.write(path, tone(2.0, rate), rate, format=fmt, subtype=subtype)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) / SR - 2.0) < 0.1
    # The tone survives decoding and resampling: its spectrum peaks at 440 Hz.
    spectrum = np.abs(np.fft.rfft(audio[:SR]))
    assert abs(int(np.argmax(spectrum)) - 440) < 5  # a 1 s window: bin k is k Hz


def test_stereo_is_mixed_and_resampled(tmp_path):
    left = tone(1.0, 44100, 440)
    right = tone(1.0, 44100, 1000)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, np.stack([left, right], axis=1), 44100)
    audio = load_audio(path.read_bytes())  # bytes work as well as paths
    assert len(audio) == SR
    spectrum = np.abs(np.fft.rfft(audio))
    peaks = sorted(np.argsort(spectrum)[-2:])
    assert peaks == [440, 1000]


def test_arrays_are_taken_at_their_rate():
    assert len(load_audio(tone(1.0, 8000), sample_rate=8000)) == SR
    pcm = (tone(0.5, SR) * 32767).astype(np.int16)
    assert np.abs(load_audio(pcm)).max() == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (b"", "empty"),
        (b"definitely not audio" * 10, "could not decode"),
        (np.zeros(0, np.float32), "empty"),
        (np.array([0.0, np.nan], np.float32), "NaN"),
        (np.zeros((2, 2, 2), np.float32), "shape"),
        ("/nonexistent/file.wav", "not found"),
    ],
)
def test_bad_audio_gives_clear_errors(source, message):
    with pytest.raises(AudioError, match=message):
        load_audio(source)


def test_a_flac_cut_off_after_its_first_blocks_keeps_what_it_holds(tmp_path):
    """An upload that breaks off ("flac decoder lost sync") past libsndfile's first block of
    44.1 kHz stereo (~12 s): what was decoded stays, and the failed block is read up to the
    damage. With pieces cut while reading it used to be refused, since starting over in ffmpeg
    would send them twice."""
    rate, seconds = 44_100, 30
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, (rate * seconds, 2)).astype(np.float32)
    soundfile.write(tmp_path / "whole.flac", noise, rate)
    data = (tmp_path / "whole.flac").read_bytes()
    cut = data[: int(len(data) * 0.6)]
    seen = []
    samples = load_audio(cut, on_progress=lambda so_far, declared_s: seen.append(len(so_far)))
    assert len(seen) >= 2  # pieces could have been cut before the damage was found
    assert 0.6 * seconds - 1 < len(samples) / SAMPLE_RATE < 0.6 * seconds + 0.5
    np.testing.assert_array_equal(samples[: seen[0]], load_audio(data)[: seen[0]])



def test_a_damaged_frame_in_the_middle_of_a_flac_is_skipped_not_the_rest():
    """Twenty bytes flipped halfway through a FLAC (a bit error in transit): everything after
    them was lost, with a 200. The frames that cannot be read are silence, the rest is there,
    where it was; a FLAC cut off at the same point still keeps what it holds."""
    rate, seconds = 16_000, 200
    noise = np.random.default_rng(1).uniform(-0.5, 0.5, rate * seconds).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, noise, rate, format="FLAC")
    data = buffer.getvalue()
    damaged = bytearray(data)
    for k in range(20):
        damaged[len(data) // 2 + k] ^= 0xA5
    whole, samples = load_audio(data), load_audio(bytes(damaged))
    assert len(samples) == len(whole)
    differ = np.flatnonzero(samples != whole)
    assert 0 < len(differ) <= 2 * 4096 and not samples[differ].any()  # a frame or two, silent
    assert 0.4 * seconds < differ[0] / rate < 0.6 * seconds
    cut = load_audio(data[: len(data) // 2])
    assert 0.45 * seconds < len(cut) / rate < 0.55 * seconds


@pytest.mark.parametrize("subtype", ["VORBIS", "OPUS"])
def test_a_chained_ogg_file_is_read_whole(subtype):
    """Ogg files joined byte for byte (a radio stream's recording, `cat a.ogg b.ogg`) are one
    chained stream: libsndfile read the first file only, and its length was the whole's."""
    if subtype not in soundfile.available_subtypes("OGG"):
        pytest.skip(f"this libsndfile writes no Ogg {subtype}")
    parts = []
    for seconds, freq in ((3, 440.0), (4, 660.0)):
        buffer = io.BytesIO()
        soundfile.write(buffer, tone(seconds, 48_000, freq), 48_000, format="OGG", subtype=subtype)
        parts.append(buffer.getvalue())
    samples = load_audio(b"".join(parts))
    assert abs(len(samples) / SAMPLE_RATE - 7.0) < 0.1
    assert np.sqrt(np.mean(samples[-SAMPLE_RATE:] ** 2)) > 0.1  # the second file's tone, not silence
    if subtype == "OPUS" and "VORBIS" in soundfile.available_subtypes("OGG"):
        # A Vorbis file joined to an Opus one: ffmpeg's demuxer gives up at the second; the first
        # is kept, as a file cut off is (a 400 for the whole, before).
        vorbis = io.BytesIO()
        soundfile.write(vorbis, tone(3, 48_000), 48_000, format="OGG", subtype="VORBIS")
        assert abs(len(load_audio(vorbis.getvalue() + parts[1])) / SAMPLE_RATE - 3.0) < 0.2
    # Refused from one file's length, which is all the container declares: the message says so
    # rather than call the 7 s file 4 s long.
    with pytest.raises(AudioTooLongError, match=r"audio is at least [34]\.0 s long; at most 2 s"):
        load_audio(b"".join(parts), max_duration_s=2)


@pytest.mark.parametrize("codec", [["-c:a", "libmp3lame", "-q:a", "6", "-write_xing", "0", "-f", "mp3"],
                                   ["-c:a", "aac", "-q:a", "2", "-f", "adts"]], ids=["mp3", "adts-aac"])
def test_an_estimated_length_neither_refuses_nor_is_reported(codec):
    """Without a Xing header libsndfile estimates an MP3's length from its first frame, and
    ffmpeg a bare ADTS AAC stream's from its bitrate: for VBR audio that starts quiet, 22 s came
    out as ~60 s (MP3) and ~51 s (AAC). The length is checked, and reported to on_progress
    (where the server charges it), as the file is decoded."""
    require_ffmpeg()
    loud = np.random.default_rng(0).uniform(-0.5, 0.5, 20 * SAMPLE_RATE)
    quiet_then_loud = np.concatenate([np.zeros(2 * SAMPLE_RATE), loud])
    wav = io.BytesIO()
    soundfile.write(wav, quiet_then_loud.astype(np.float32), SAMPLE_RATE, format="WAV")
    encoded = subprocess.run(["ffmpeg", "-loglevel", "error", "-i", "pipe:0", *codec, "pipe:1"],
                             input=wav.getvalue(), capture_output=True, check=True).stdout
    declared = []
    samples = load_audio(encoded, max_duration_s=30, on_progress=lambda so_far, declared_s: declared.append(declared_s))
    assert abs(len(samples) / SAMPLE_RATE - 22) < 0.2 and set(declared) == {0.0}
    with pytest.raises(AudioTooLongError):
        load_audio(encoded, max_duration_s=15)


def _ffmpeg(source: bytes, *arguments: str) -> bytes:
    return subprocess.run(["ffmpeg", "-loglevel", "error", "-i", "pipe:0", *arguments, "pipe:1"],
                          input=source, capture_output=True, check=True).stdout


def _wav_bytes(samples: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    wav = io.BytesIO()
    soundfile.write(wav, samples.astype(np.float32), rate, format="WAV")
    return wav.getvalue()


def test_a_vbr_mp3_whose_first_frames_are_loud_is_read_whole():
    """The other side of the estimate: a VBR MP3 without a Xing header that starts loud gets a
    length from its first frame's high bitrate that is too short, and libsndfile stopped there
    without an error (105 s of speech after a burst of noise came back as 29.6 s)."""
    require_ffmpeg()
    rng = np.random.default_rng(0)
    loud = rng.uniform(-0.9, 0.9, 2 * 44_100)
    quiet = 0.01 * np.sin(2 * np.pi * 220 * np.arange(40 * 44_100) / 44_100)
    encoded = _ffmpeg(_wav_bytes(np.concatenate([loud, quiet]), 44_100),
                      "-c:a", "libmp3lame", "-q:a", "2", "-write_xing", "0", "-f", "mp3")
    assert abs(len(load_audio(encoded)) / SAMPLE_RATE - 42) < 0.2


@pytest.mark.parametrize("suffix, codec", [("m4a", "aac"), ("webm", "libopus"), ("mkv", "pcm_s16le")])
def test_eight_channel_files_are_mixed_down(speech_files, tmp_path, suffix, codec):
    """7.1 audio through ffmpeg: PyAV's planar 8-channel frames crashed the process in
    to_ndarray (a segfault that took the server down), so the decode runs in a child here."""
    require_ffmpeg()
    path = tmp_path / f"eight.{suffix}"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(speech_files[1]), "-filter_complex",
                    "[0:a]pan=7.1|c2=c0[a]", "-map", "[a]", "-c:a", codec, str(path)], check=True)
    check = ("import sys, numpy as np; from asrserve.audio.decode import load_audio; "
             "a = load_audio(sys.argv[1]); print(len(a), float(np.sqrt(np.mean(a ** 2))))")
    child = subprocess.run([sys.executable, "-c", check, str(path)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    length, rms = child.stdout.split()
    wav = load_audio(speech_files[1])
    assert abs(int(length) - len(wav)) < 0.1 * SAMPLE_RATE
    # One channel of eight carries the speech: the mix holds it at an eighth of its level.
    assert float(rms) == pytest.approx(np.sqrt(np.mean(wav**2)) / 8, rel=0.25)


@pytest.mark.parametrize("suffix", ["mp3", "m4a"])
def test_a_damaged_frame_is_skipped_as_ffmpeg_skips_it(speech_files, tmp_path, suffix):
    """A hundred bytes overwritten across the file: libsndfile stopped an MP3 at the first
    damaged frame without an error (2 s of 5.9 kept), and an m4a was refused whole when its
    first packets were damaged or ffmpeg answered a damaged AAC frame with EPERM rather than
    "invalid data". Both now keep every frame the ffmpeg command keeps."""
    require_ffmpeg()
    path = tmp_path / f"whole.{suffix}"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(speech_files[1]), str(path)], check=True)
    whole = path.read_bytes()
    for seed in range(6):
        rng = np.random.default_rng(seed)
        damaged = bytearray(whole)
        for at in rng.choice(np.arange(2000, len(whole)), 100, replace=False):
            damaged[at] = int(rng.integers(0, 256))
        (tmp_path / f"damaged.{suffix}").write_bytes(damaged)  # a file: an m4a's index is read by seeking
        decoded = subprocess.run(["ffmpeg", "-loglevel", "quiet", "-i", str(tmp_path / f"damaged.{suffix}"), "-ac", "1",
                                  "-ar", "16000", "-f", "f32le", "pipe:1"], capture_output=True).stdout
        if not decoded:  # the damage hit what ffmpeg needs to read anything: audio or a clear error
            try:
                load_audio(bytes(damaged))
            except AudioError:
                pass
            continue
        # (an AAC frame more or less: 64 ms at 16 kHz)
        assert abs(len(load_audio(bytes(damaged))) - len(decoded) // 4) < 0.1 * SAMPLE_RATE, seed


def test_an_mp3_joined_from_mono_and_stereo_files_is_read_whole():
    """MP3 files joined byte for byte (cat a.mp3 b.mp3: radio rips, joined recordings) change
    channels and rate mid-stream. Every frame is converted to the layout the file opened with:
    the stereo part came out twice as long at half its pitch, or the upload was refused."""
    require_ffmpeg()
    tone = lambda seconds, rate: 0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate)  # noqa: E731
    parts = [_ffmpeg(_wav_bytes(tone(3, 44_100), 44_100), "-ac", "1", "-f", "mp3"),
             _ffmpeg(_wav_bytes(tone(3, 44_100), 44_100), "-ac", "2", "-f", "mp3"),
             _ffmpeg(_wav_bytes(tone(3, 16_000), 16_000), "-ac", "1", "-f", "mp3")]
    for joined in (b"".join(parts), b"".join(parts[::-1])):
        by_ffmpeg = len(_ffmpeg(joined, "-ac", "1", "-ar", "16000", "-f", "f32le")) // 4
        assert abs(len(load_audio(joined)) - by_ffmpeg) < 0.05 * SAMPLE_RATE


def test_wav_with_zero_samples(tmp_path):
    path = tmp_path / "empty.wav"
    soundfile.write(path, np.zeros(0, np.float32), SR)
    with pytest.raises(AudioError, match="empty"):
        load_audio(path)


def test_long_audio_is_cut_in_the_quietest_window():
    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal(SR * 75)).astype(np.float32)
    pauses = [(29.4, 29.7), (58.2, 58.6)]  # inside the last second of each 30 s span
    for start, end in pauses:
        audio[int(start * SR):int(end * SR)] *= 0.001
    pieces = split_audio(audio)
    assert len(pieces) == 3
    assert all(len(p.samples) <= 30 * SR for p in pieces)
    assert np.array_equal(np.concatenate([p.samples for p in pieces]), audio)
    first_cut = pieces[1].offset / SR
    second_cut = pieces[2].offset / SR
    assert pauses[0][0] <= first_cut <= pauses[0][1]
    assert pauses[1][0] <= second_cut <= pauses[1][1]
    assert second_cut - first_cut <= 30


def test_short_audio_is_one_piece():
    audio = np.ones(SR * 30, np.float32)
    assert [(p.offset, len(p.samples)) for p in split_audio(audio)] == [(0, SR * 30)]


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_transformers(n_mels):
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(1)
    audios = [
        (0.1 * rng.standard_normal(n)).astype(np.float32) for n in (SR * 3, SR * 30, 1234, SR * 17)
    ] + [tone(5.0, SR)]
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    ours = LogMelSpectrogram(n_mels, torch.device("cpu"))(audios).numpy()
    assert ours.shape == (len(audios), n_mels, 3000) and ours.dtype == np.float32
    batched = extractor(audios, sampling_rate=SR, return_tensors="np").input_features
    assert np.abs(ours - batched).max() < 1e-4
    # The numpy path (no torch) computes in float64: the same within 1e-4.
    for audio, mel in zip(audios, ours):
        padded = np.zeros(30 * SR, np.float32)
        padded[: len(audio)] = audio
        reference = extractor._np_extract_fbank_features(padded[None], "cpu")[0]
        assert np.abs(mel - reference).max() < 1e-4


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_of_the_audios_frames_only_equals_the_whole_windows(n_mels):
    """On CPU each audio's STFT covers only the frames that reach its samples; the frames in the
    padding are filled in. Against the whole 30 s window's computation (the batch path CUDA
    takes): the same bits from a few hundred samples up (below, one float32 rounding of the mel
    product), at lengths on either side of a hop, of the half window, and of the window's end."""
    mel = LogMelSpectrogram(n_mels, torch.device("cpu"))
    rng = np.random.default_rng(2)
    hop, half = 160, 200
    lengths = [1, hop - 1, hop, hop + 1, half, half + 1, 2 * half, SR * 5 + 37, SR * 30 - half - 1,
               SR * 30 - half, SR * 30 - 1, SR * 30]
    for n in lengths:
        audio = (0.1 * rng.standard_normal(n)).astype(np.float32)
        padded = torch.zeros(1, 30 * SR)
        padded[0, :n] = torch.from_numpy(audio)
        whole = mel.from_padded(padded)[0]
        ours = mel.of_one(audio)
        if n > 2 * half:
            assert torch.equal(ours, whole), n
        else:
            assert (ours - whole).abs().max() <= 2.0**-21, n
    quiet = np.zeros(SR, np.float32)  # all padding-like: every frame at the floor, as before
    assert torch.equal(mel.of_one(quiet), mel.from_padded(torch.zeros(1, 30 * SR))[0])


@pytest.mark.parametrize("suffix", ["m4a", "webm", "mp4", "aac"])
def test_containers_libsndfile_refuses_decode_through_ffmpeg(speech_files, tmp_path, suffix):
    require_ffmpeg()
    wav = load_audio(speech_files[1])
    path = tmp_path / f"clip.{suffix}"
    command = ["ffmpeg", "-loglevel", "error", "-y", "-i", str(speech_files[1]), str(path)]
    subprocess.run(command, check=True)
    for source in (path, path.read_bytes()):
        decoded = load_audio(source)
        assert decoded.dtype == np.float32 and decoded.ndim == 1
        assert abs(len(decoded) - len(wav)) < 0.1 * SAMPLE_RATE  # codec priming adds a few ms
        assert np.sqrt(np.mean(decoded**2)) == pytest.approx(np.sqrt(np.mean(wav**2)), rel=0.2)


def test_video_without_audio_and_duration_limits(speech_files, tmp_path):
    require_ffmpeg()
    video = tmp_path / "video.mp4"
    subprocess.run(
        ["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", "testsrc=duration=1", str(video)], check=True
    )
    with pytest.raises(AudioError, match="no audio stream"):
        load_audio(video)
    m4a = tmp_path / "clip.m4a"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(speech_files[1]), str(m4a)], check=True)
    for source in (speech_files[1], m4a):
        with pytest.raises(AudioTooLongError, match="at most 1 s"):
            load_audio(source, max_duration_s=1)
        assert len(load_audio(source, max_duration_s=60)) > SAMPLE_RATE


@pytest.mark.parametrize("rate, channels", [(16000, 1), (44100, 2)])
def test_decoding_ten_minutes_holds_the_result_about_once(rate, channels):
    """The decoded blocks go into one buffer sized from the length the file declares. Joined
    at the end, they held the audio twice: 230 MB more for an hour, in every preprocessing
    thread decoding one."""
    import io
    import tracemalloc

    tone = (0.1 * np.sin(2 * np.pi * 220 * np.arange(600 * rate) / rate)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.stack([tone] * channels, axis=1), rate, format="FLAC")
    data = buffer.getvalue()
    del tone, buffer
    tracemalloc.start()
    try:
        samples = load_audio(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(samples) == 600 * SAMPLE_RATE
    assert peak - samples.nbytes < 0.5 * samples.nbytes, (peak >> 20, samples.nbytes >> 20)


def test_a_wav_whose_data_size_was_never_written_is_read_whole(tmp_path):
    """A recorder cut off (or one that streams) leaves 0 in the header's data size: libsndfile
    then sees no frames, ffmpeg (and OpenAI) read the samples that follow. It was refused as
    empty."""
    import struct

    buffer = io.BytesIO()
    soundfile.write(buffer, tone(2.0, SR), SR, format="WAV", subtype="PCM_16")
    data = bytearray(buffer.getvalue())
    struct.pack_into("<I", data, data.find(b"data") + 4, 0)
    struct.pack_into("<I", data, 4, 0)
    assert len(load_audio(bytes(data))) == 2 * SR


def test_a_flac_of_unknown_length_is_read_whole():
    """A FLAC written to a pipe (ffmpeg -f flac -) leaves STREAMINFO's total samples at 0,
    "unknown": libsndfile then reports SF_COUNT_MAX frames, and the file was refused as
    576460752303423.5 s long."""
    buffer = io.BytesIO()
    soundfile.write(buffer, tone(2.0, SR), SR, format="FLAC", subtype="PCM_16")
    data = bytearray(buffer.getvalue())
    assert data[:4] == b"fLaC"
    info = 8  # STREAMINFO's fields: total samples are the low 36 bits of its bytes 10-17
    data[info + 13] &= 0xF0
    data[info + 14 : info + 18] = bytes(4)
    assert soundfile.info(io.BytesIO(bytes(data))).frames > 2**62
    assert len(load_audio(bytes(data), max_duration_s=60)) == 2 * SR


def test_many_channels_at_a_high_rate_shrink_the_duration_limit(tmp_path):
    """Decoding costs by every channel's samples: a small FLAC of 8 channels at 384 kHz
    (silence compresses to nothing) held a preprocessing worker for minutes at an accepted
    length. Past 8 channels at 48 kHz the limit shrinks in proportion; at or below, it holds."""
    silent = np.zeros((2 * 384_000, 8), np.float32)
    path = tmp_path / "wide.flac"
    soundfile.write(path, silent, 384_000, format="FLAC")
    with pytest.raises(AudioTooLongError, match="8 channels at 384000 Hz"):
        load_audio(path, max_duration_s=10)  # 2 s of it costs what 16 s at 8 x 48 kHz would
    assert len(load_audio(path, max_duration_s=20)) == 2 * SR
    film = tmp_path / "film.flac"
    soundfile.write(film, np.zeros((2 * 48_000, 8), np.float32), 48_000, format="FLAC")
    assert len(load_audio(film, max_duration_s=2)) == 2 * SR


def test_float_audio_past_full_scale_is_clipped_as_ffmpeg_clips_it(tmp_path):
    """Speech at 1000 times full scale in a float WAV was read as silence (log-mel is not
    scale-free); ffmpeg's conversion to 16-bit clips it for openai/whisper and faster-whisper."""
    path = tmp_path / "loud.wav"
    soundfile.write(path, 1000 * tone(1.0, 44_100), 44_100, format="WAV", subtype="FLOAT")
    for source in (path, 1000 * tone(1.0, SR)):
        samples = load_audio(source)
        assert np.abs(samples).max() <= 1.0 and np.mean(np.abs(samples) > 0.99) > 0.5


def test_pipes_and_unseekable_streams_are_read(tmp_path):
    """A pipe given as a path (the shell's <(cat a.flac)) was "audio file not found"; a file
    object that cannot seek (a pipe, stdin) raised OSError "Illegal seek" out of the decoders."""
    import os
    import threading

    buffer = io.BytesIO()
    soundfile.write(buffer, tone(1.0, SR), SR, format="FLAC")
    data = buffer.getvalue()

    def feed(write) -> threading.Thread:
        thread = threading.Thread(target=lambda: (write(data), None))
        thread.start()
        return thread

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write_fifo(payload: bytes) -> None:
        with open(fifo, "wb") as sink:
            sink.write(payload)

    thread = feed(write_fifo)
    try:
        assert len(load_audio(fifo)) == SR
    finally:
        thread.join(timeout=10)
        if thread.is_alive():  # the decoder never opened the pipe: let the writer finish
            with open(fifo, "rb") as source:
                source.read()
    read_end, write_end = os.pipe()
    thread = feed(lambda payload: (os.write(write_end, payload), os.close(write_end)))
    with os.fdopen(read_end, "rb") as stream:
        assert len(load_audio(stream)) == SR
    thread.join()


def test_a_codec_ffmpeg_does_not_know_is_named_as_such(tmp_path):
    """A WAV with an unknown format tag was refused for "a sample rate of 0 Hz" (its header
    says 16000)."""
    import struct

    buffer = io.BytesIO()
    soundfile.write(buffer, tone(1.0, SR), SR, format="WAV", subtype="PCM_16")
    data = bytearray(buffer.getvalue())
    struct.pack_into("<H", data, 20, 0x1234)
    with pytest.raises(AudioError, match="unknown or damaged codec"):
        load_audio(bytes(data))


def test_a_file_name_that_is_not_utf8_is_read(tmp_path):
    """A Latin-1 name (café in one byte): libsndfile and ffmpeg take names as UTF-8, and the
    error blamed the audio ("could not decode audio: 'utf-8' codec can't encode")."""
    import os

    name = os.fsencode(tmp_path) + b"/caf\xe9.flac"
    soundfile.write(name, tone(1.0, SR), SR, format="FLAC")
    assert len(load_audio(os.fsdecode(name))) == SR


def test_ffmpeg_opens_no_file_an_upload_names(tmp_path, monkeypatch):
    """ffmpeg picks its demuxer by probing the bytes: a concat script ("file a.ts") or a playlist
    would open the files it names, from the working directory. Only audio and video containers
    are read, in memory; the error is the same whether a named file exists or not."""
    require_ffmpeg()
    monkeypatch.chdir(tmp_path)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "sine=frequency=440:duration=2",
                    "-f", "mpegts", "a.ts"], check=True)
    assert abs(len(load_audio("a.ts")) / SAMPLE_RATE - 2.0) < 0.1  # a real container, read as a file
    # Every other container ffmpeg reads still is, however rare (a list of usual ones refused
    # dictation recorders' DSS, nginx-rtmp's FLV, Yamaha SMAF, ...).
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "sine=frequency=440:duration=2", "-ar", "8000",
                    "-c:a", "adpcm_yamaha", "-f", "mmf", "a.mmf"], check=True)
    assert abs(len(load_audio((tmp_path / "a.mmf").read_bytes())) / SAMPLE_RATE - 2.0) < 0.1
    messages = []
    for script in (b"ffconcat version 1.0\nfile a.ts\n", b"ffconcat version 1.0\nfile missing.ts\n",
                   b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:2,\na.ts\n#EXT-X-ENDLIST\n"):
        with pytest.raises(AudioError) as caught:
            load_audio(script)
        messages.append(str(caught.value))
        (tmp_path / "script.txt").write_bytes(script)  # and as a local file, offline
        with pytest.raises(AudioError):
            load_audio("script.txt")
    assert messages[0] == messages[1], messages  # a.ts exists, missing.ts does not
