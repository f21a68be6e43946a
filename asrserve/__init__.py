"""asrserve: an OpenAI-compatible speech-to-text inference server for Whisper models."""

__version__ = "0.1.0"

# Imported on first use, so `asrserve --help` does not wait for torch.
_LAZY = {
    "ASR": "asrserve.entrypoints.offline",
    "Transcription": "asrserve.entrypoints.offline",
    "SamplingParams": "asrserve.engine.request",
    "AudioError": "asrserve.errors",
    "InvalidRequestError": "asrserve.errors",
    "ModelLoadError": "asrserve.errors",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'asrserve' has no attribute {name!r}")
