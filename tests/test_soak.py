"""The soak benchmark (benchmarks/soak.py) in small: every mode (json, verbose_json with words,
streaming, srt) back to back on one server; nothing fails and the engine ends holding nothing.
The full run (2000 requests, memory growth under 5% after warm-up) is in docs/benchmarks.md."""

from __future__ import annotations

import pytest

from benchmarks.soak import MODES, mixed_workload, run_soak
from tests.conftest import require_espeak

pytestmark = pytest.mark.slow


def test_a_short_soak_in_every_mode_frees_everything(tmp_path):
    require_espeak()
    files = mixed_workload(tmp_path, long_audio=False)
    result = run_soak(num_requests=48, concurrency=8, segment=12, warmup=12, files=files,
                      server_args=("--dtype", "float32"))
    assert result["failed"] == 0, result["timeline"]
    assert [point["mode"] for point in result["timeline"]] == [
        response_format + (" stream" if stream else "") for response_format, stream, _ in MODES
    ]
    assert not any(result["engine_held_after"].values()), result["engine_held_after"]
    assert result["rss_mb_after_warmup"] > 0 and result["rss_mb_end"] > 0
