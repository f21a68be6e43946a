"""Overload (benchmarks/overload.py): 200 requests at once against a server that takes 2 at a
time and lets 8 wait. The excess is refused with 429 and Retry-After, everything accepted
succeeds, memory does not grow from one burst to the next, and the server is healthy after."""

from __future__ import annotations

import pytest

from benchmarks.overload import run_overload

pytestmark = pytest.mark.slow


def test_two_hundred_at_once(speech_files):
    result = run_overload(num_requests=200, max_num_seqs=2, max_waiting=8, audio=speech_files[4].read_bytes())
    statuses = result["statuses"]
    assert set(statuses) <= {"200", "429", "503"}, statuses  # no 5xx but "busy", no dropped connection
    accepted, refused = statuses.get("200", 0), statuses.get("429", 0) + statuses.get("503", 0)
    assert accepted >= 2 * 8 and refused >= 2 * 100, statuses
    assert result["refused_with_retry_after"] == refused
    assert result["refused_codes"] == ["server_busy"]
    assert result["refused_latency_ms_max"] < 30_000  # refused at once, not after queueing
    assert result["accepted_texts_as_expected"] == accepted
    first, second = result["rss_mb_peak_per_burst"]
    assert second <= first * 1.05, result
    assert first <= result["rss_mb_before"] + 512, result  # bounded by the waiting bound, not the burst
    # Idle a moment, the engine has handed its freed heap back: memory is where it started.
    assert all(idle <= result["rss_mb_before"] * 1.03 for idle in result["rss_mb_idle_after_burst"]), result
    assert not any(result["engine_held_after"].values()), result
    assert result["health_after"] == 200 and result["text_after_as_expected"] and result["server_alive"]
