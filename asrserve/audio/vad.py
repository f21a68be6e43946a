"""Voice-activity detection with Silero VAD: cut long audio into speech pieces for Whisper.

Used for OpenAI's `chunking_strategy={"type": "server_vad", ...}`: find where people speak,
skip the rest (never decoded, so no hallucinated text on silence), and merge speech into
pieces of at most 30 s that start and end in pauses.

Why our own model code: the silero-vad package runs its 512-sample windows one Python call at
a time (~64x real time on one thread). The model is a convolutional front end applied to each
window independently, then an LSTM, then a linear head; only the LSTM is sequential. So we run
the front end over all windows in a few large batched convolutions and the LSTM over each
block of them in one call. Same weights, same numbers within 1e-3, many times faster, which
matters on a small CPU server where VAD competes with decoding.

The weights come from the package's silero_vad.jit, the model its load_silero_vad() and
get_speech_timestamps() use. Its silero_vad_16k.safetensors (for the tinygrad port) holds a
different set of weights (only the STFT basis is the same; silero-vad issue #768) whose
probabilities differ from the jit model's by up to ~0.5, so we do not use it.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from asrserve.audio.chunking import AudioPiece
from asrserve.audio.vad_regions import CUT_LOOKBACK_MS, WINDOW, pad_regions, piece_spans, raw_regions
from asrserve.config import N_SAMPLES

CONTEXT = 64  # samples of the previous window each window also sees
BLOCK_WINDOWS = 2048  # windows per block (~65 s of audio): bounds memory on long audio
_PACKAGE = "silero_vad"

# Defaults for offline transcription (OpenAI's server_vad defaults, 500 ms of silence, are tuned
# for ending a live turn; offline we want to find pauses to cut at and silence to skip):
# - threshold 0.5: Silero's own default; robust across datasets.
# - prefix_padding_ms 300: kept before (and after) speech so Whisper hears the onset and the
#   final consonants in full; Silero's probability lags speech by a window or two.
# - silence_duration_ms 200: a pause this long ends a speech region. Shorter pauses (stop
#   closures, 100 ms hesitations) occur inside words and phrases; 200 ms of silence almost
#   always falls between words, so every region boundary is a safe place to cut, and there
#   are enough of them to pack pieces close to 30 s.
# - min_speech_ms 100: drop blips shorter than this; a short word ("no", "yes") is 150-300 ms
#   and losing a word costs more than decoding a short noise.
DEFAULT_THRESHOLD = 0.5
DEFAULT_PREFIX_PADDING_MS = 300
DEFAULT_SILENCE_DURATION_MS = 200
DEFAULT_MIN_SPEECH_MS = 100

_INSTALL_HINT = "server_vad chunking needs the Silero VAD model: pip install silero-vad"


class VADUnavailableError(ImportError):
    """Silero VAD cannot be loaded in this install: the package or its weights are missing,
    unreadable, or of a version whose model this module does not read. An ImportError, as a
    missing package is: callers that can go on without the VAD catch that."""


def _weights_path() -> Path:
    # find_spec on the top-level package does not import it: importing silero_vad (or
    # importlib.resources on silero_vad.data) would run its model.py, which calls
    # torch.set_num_threads(1) for the whole process.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise VADUnavailableError(_INSTALL_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.jit"
    if not path.is_file():
        raise VADUnavailableError(f"{_INSTALL_HINT} (its {path} is missing)")
    return path


class SileroVAD:
    """Silero VAD v5/v6 (16 kHz), batched over windows. Thread-safe: weights are read-only and
    every call keeps its state in local tensors."""

    def __init__(self, weights: Path | None = None):
        import torch

        with warnings.catch_warnings():  # torch 2.10+ deprecates TorchScript; we only read its tensors
            warnings.simplefilter("ignore", DeprecationWarning)
            path = weights or _weights_path()
            try:
                jit = torch.jit.load(str(path), map_location="cpu")
            except Exception as error:  # a damaged or truncated install
                raise VADUnavailableError(f"could not read Silero VAD's weights {path}: {error}") from error
        state = {
            name[len("_model.") :]: tensor.detach().clone().float()
            for name, tensor in jit.state_dict().items()
            if name.startswith("_model.")
        }
        del jit  # we keep only the 16 kHz model's tensors
        try:
            self._read(state)
        except VADUnavailableError:
            raise
        except Exception as error:  # another version's model: other names (KeyError), other shapes
            raise VADUnavailableError(f"this silero-vad version is not supported: {type(error).__name__} {error}") from None

    def _read(self, state: dict) -> None:
        import torch

        # The STFT is a conv whose rows are a periodic-Hann-windowed DFT (cos and sin rows);
        # rfft of the windowed frames gives the same magnitudes with far fewer operations.
        basis = state["stft.forward_basis_buffer"][:, 0]  # [258, 256]
        self.hann = torch.hann_window(256, periodic=True)
        dft = torch.fft.rfft(torch.eye(256) * self.hann, dim=0)  # column n: frame sample n
        if not torch.allclose(torch.cat([dft.real, dft.imag]), basis, atol=1e-5):
            raise VADUnavailableError("unexpected Silero VAD STFT basis: this silero-vad version is not supported")
        # The encoder convs (kernel 3, padding 1) as matrices over [tap, in channel] rows.
        self.convs = []
        for i, stride in enumerate((1, 2, 2, 1)):
            weight = state[f"encoder.{i}.reparam_conv.weight"]  # [out, in, 3]
            matrix = weight.permute(2, 1, 0).reshape(-1, weight.shape[0]).contiguous()
            self.convs.append((matrix, state[f"encoder.{i}.reparam_conv.bias"], stride))
        self.lstm = torch.nn.LSTM(128, 128, batch_first=True)  # same gate layout as LSTMCell
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(self.lstm, f"{name}_l0").data.copy_(state[f"decoder.rnn.{name}"])
        self.lstm.requires_grad_(False).eval()
        self.head_weight = state["decoder.decoder.2.weight"][:, :, 0]  # [1, 128]
        self.head_bias = state["decoder.decoder.2.bias"]

    def _front_end(self, windows):
        """[B, 576] windows (context + samples) -> [B, 128] LSTM inputs."""
        import torch
        import torch.nn.functional as F

        x = F.pad(windows.unsqueeze(1), (0, CONTEXT), mode="reflect")[:, 0]  # [B, 640]
        x = torch.fft.rfft(x.unfold(1, 256, 128) * self.hann).abs()  # [B, 4 frames, 129 bins]
        for matrix, bias, stride in self.convs:  # channels last: [B, frames, channels]
            taps = F.pad(x, (0, 0, 1, 1)).unfold(1, 3, stride)  # [B, frames out, channels, 3]
            # One [B * frames, 3 * channels] product: a 3-D operand that cannot be viewed as
            # 2-D (as this reshape of strided taps) sends matmul to a bmm against the matrix
            # expanded per window, twice as slow on one thread.
            rows = taps.transpose(2, 3).reshape(-1, matrix.shape[0])
            x = torch.relu(torch.addmm(bias, rows, matrix)).view(x.shape[0], taps.shape[1], -1)
        return x[:, 0]  # down to one frame per window

    def probabilities(self, samples: np.ndarray) -> np.ndarray:
        """One speech probability per 512-sample window (the last one zero-padded), float32."""
        samples = np.asarray(samples, dtype=np.float32)
        count = -(-len(samples) // WINDOW)
        probs = np.zeros(count, np.float32)
        state = None
        # Block by block, the LSTM's state carried over: memory stays that of one block
        # whatever the length (over an hour at once, the padded copy, the features and the
        # LSTM's gates took ~450 MB more than the audio).
        for first in range(0, count, BLOCK_WINDOWS):
            num = min(BLOCK_WINDOWS, count - first)
            probs[first : first + num], state = self.block_probabilities(samples, first, num, state)
        return probs

    def block_probabilities(self, samples: np.ndarray, first: int, num: int, lstm_state):
        """The probabilities of windows [first, first + num) of float32 `samples` and the LSTM
        state after them, given the state after window first - 1 (None at the start). Window k
        sees samples [512k - 64, 512k + 512): zeros before the start, as the reference's
        initial context, and zeros after the end, as its padded last window. Blocks that start
        at the same windows give the same numbers whether the audio is complete or not."""
        import torch

        with torch.inference_mode(), _one_thread():
            begin = first * WINDOW - CONTEXT
            audio = torch.zeros(CONTEXT + num * WINDOW)
            chunk = samples[max(0, begin) : begin + CONTEXT + num * WINDOW]
            audio[max(0, -begin) : max(0, -begin) + len(chunk)] = torch.from_numpy(chunk)
            windows = audio.unfold(0, WINDOW + CONTEXT, WINDOW)  # [num, 576], a view
            hidden, lstm_state = self._recur(self._front_end(windows), lstm_state)
            return self._head(hidden), lstm_state

    def _head(self, hidden) -> np.ndarray:
        import torch

        logits = torch.relu(hidden) @ self.head_weight.T + self.head_bias
        return torch.sigmoid(logits)[:, 0].numpy()

    def continue_probabilities(self, windows: np.ndarray, lstm_state):
        """Streaming: the speech probabilities of [count, 576] windows (each with its 64
        samples of context) that follow those a caller has already run, and the LSTM state to
        pass with the next ones (None at a stream's start). The model is shared; the state is
        the caller's."""
        import torch

        with torch.inference_mode(), _one_thread():
            features = self._front_end(torch.from_numpy(np.array(windows, dtype=np.float32)))  # a copy: views are read-only
            hidden, lstm_state = self._recur(features, lstm_state)
            return self._head(hidden), lstm_state

    def _recur(self, features, lstm_state):
        """The LSTM over [count, 128] features in runs whose lengths are powers of two, the
        state carried from run to run (the same recurrence). torch's CPU LSTM goes to oneDNN,
        which builds and caches a primitive for every sequence length it sees (~0.24 MB each, up
        to 1024 of them): scoring audio of every length grew the server's memory by up to
        ~250 MB over hours. Powers of two leave 12 lengths (BLOCK_WINDOWS is 2048)."""
        import torch

        hidden, start = [], 0
        while start < len(features):
            run = 1 << ((len(features) - start).bit_length() - 1)  # the largest power of two that fits
            out, lstm_state = self.lstm(features[start : start + run].unsqueeze(0), lstm_state)
            hidden.append(out[0])
            start += run
        return (torch.cat(hidden) if len(hidden) > 1 else hidden[0]), lstm_state


@contextmanager
def _one_thread():
    """Runs torch ops of the calling thread on that thread alone. Concurrent requests, and the
    engine, keep the other cores busy: there, a two-thread OpenMP team per call made the VAD
    2-4x slower than one thread (each small op waits for a descheduled partner), and several
    preprocessing threads with a team each oversubscribed the cores. torch.set_num_threads
    changes this thread's OpenMP/MKL count, and the default for threads that start torch
    meanwhile; both go back to what they were afterwards."""
    import torch

    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


_vad: SileroVAD | None = None
_vad_lock = threading.Lock()


def get_vad() -> SileroVAD:
    """The process's shared model, loaded on first use."""
    global _vad
    if _vad is None:
        with _vad_lock:
            if _vad is None:
                _vad = SileroVAD()
    return _vad


def speech_probabilities(samples: np.ndarray) -> np.ndarray:
    """Speech probability of each 32 ms window of 16 kHz mono audio."""
    return get_vad().probabilities(samples)


def regions_from_probabilities(
    probs: np.ndarray,
    num_samples: int,
    threshold: float = DEFAULT_THRESHOLD,
    min_silence_ms: float = 100,
    speech_pad_ms: float = 30,
    min_speech_ms: float = 250,
) -> list[tuple[int, int]]:
    """[start, end) sample offsets of speech, from per-window probabilities. Same result as
    silero's get_speech_timestamps (with its defaults here): a region starts at a window with
    prob >= threshold and ends where min_silence_ms of prob < threshold - 0.15 begins; regions
    of at most min_speech_ms are dropped; each side is padded by speech_pad_ms, neighbours that
    are closer than two pads meeting halfway."""
    return pad_regions(raw_regions(probs, num_samples, threshold, min_silence_ms, min_speech_ms), num_samples, speech_pad_ms)


def speech_regions(
    samples: np.ndarray,
    threshold: float = DEFAULT_THRESHOLD,
    min_silence_ms: float = 100,
    speech_pad_ms: float = 30,
    min_speech_ms: float = 250,
    *,
    probs: np.ndarray | None = None,
) -> list[tuple[int, int]]:
    """Speech regions of 16 kHz mono `samples` as [start, end) sample offsets (see
    regions_from_probabilities); `probs` saves running the model again when already known."""
    probs = speech_probabilities(samples) if probs is None else probs
    return regions_from_probabilities(probs, len(samples), threshold, min_silence_ms, speech_pad_ms, min_speech_ms)


def vad_pieces(
    samples: np.ndarray,
    threshold: float = DEFAULT_THRESHOLD,
    prefix_padding_ms: float = DEFAULT_PREFIX_PADDING_MS,
    silence_duration_ms: float = DEFAULT_SILENCE_DURATION_MS,
    max_samples: int = N_SAMPLES,
    min_speech_ms: float = DEFAULT_MIN_SPEECH_MS,
    *,
    probs: np.ndarray | None = None,
    max_gap_ms: float | None = None,
    lookback_ms: float | None = CUT_LOOKBACK_MS,
) -> list[AudioPiece]:
    """The speech in 16 kHz mono `samples` as pieces of at most `max_samples`, in order, not
    overlapping, cut only between speech regions (or, inside a region longer than that, at its
    lowest-probability point). Audio between pieces is not speech and is left out; no speech
    at all gives []. Parameters are those of OpenAI's server_vad chunking strategy; max_gap_ms
    (None: no limit; measured in benchmarks/vad_cut_choices.py, not a default) also ends a
    piece before a pause at least that long. A piece the next speech would overfill ends at the
    longest pause in its last lookback_ms (None: at its last pause)."""
    samples = np.asarray(samples, dtype=np.float32)
    probs = speech_probabilities(samples) if probs is None else np.asarray(probs)
    raw = raw_regions(probs, len(samples), threshold, silence_duration_ms, min_speech_ms)
    spans = piece_spans(raw, probs, samples, len(samples), prefix_padding_ms, max_samples, max_gap_ms, lookback_ms)
    return [AudioPiece(start, samples[start:end]) for start, end in spans]
