"""Draft tokens (engine/draft.py) on CUDA: a step that checks a draft has several logits rows
for one request, so it runs eagerly beside the decode graphs' rows; its output must be the
decode's without a draft. Skipped without a GPU (benchmarks/gpu.sh runs it on one);
benchmarks/draft_exactness.py checks the same with real weights and speech."""

from __future__ import annotations

import itertools

import pytest
import torch

from asrserve.engine.engine_core import EngineCore
from asrserve.engine.request import SamplingParams
from tests.conftest import engine_config
from tests.hf_reference import save_random_checkpoint
from tests.test_draft_tokens import _assert_idle, _decode, _drafts
from tests.test_gpu import _audios, _count_graph_replays

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("engine_args", [{}, {"enforce_eager": True}], ids=["graphs", "eager"])
def test_drafts_change_no_fp32_output_on_cuda(tmp_path, engine_args):
    save_random_checkpoint(tmp_path, 51865)
    engine = EngineCore(engine_config(str(tmp_path), dtype="float32", max_num_seqs=8, **engine_args))
    eot = engine.tokenizer.special.eot
    replays = _count_graph_replays(engine)
    # one greedy decode (random weights fail Whisper's checks: no retries at temperature > 0)
    params = SamplingParams.transcription(0.0, decode_once=True, max_tokens=40)
    checked = 0
    for index, audio in enumerate(_audios(6)):
        tokens, logprobs, steps, reason = _decode(engine, f"plain-{index}", audio, sampling_params=params)
        # the draft is what leads the output and a draft may hold: text tokens
        text = list(itertools.takewhile(lambda token: token < eot, tokens))
        if len(text) < 8:
            continue
        for name, draft in _drafts(text, eot).items():
            drafted, drafted_logprobs, drafted_steps, drafted_reason = _decode(
                engine, f"draft-{index}-{name}", audio, sampling_params=params, draft=draft)
            assert drafted == tokens, name
            assert drafted_reason == reason
            assert drafted_logprobs == pytest.approx(logprobs, abs=1e-4), name
            if name == "exact":
                assert drafted_steps < steps, (drafted_steps, steps)
            checked += 1
            _assert_idle(engine)
    assert checked >= 6, "random weights should lead with text tokens on some audio"
    if not engine_args:
        assert replays[0] > 0, "the decodes without a draft replay graphs"
