"""Word timestamps from cross-attention: which audio frames each output token attended to.

The scores of the alignment heads (kept while decoding, so no second pass over the audio) are
softmaxed over the piece's real audio frames, normalised per frame across tokens,
median-filtered along time and averaged over heads; dynamic time warping then finds the
monotonic path through tokens and frames that attends most, and each token's time is where the
path reaches it. This is openai/whisper's recipe (timing.py); the code is ours.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from asrserve.config import HOP_LENGTH, SAMPLE_RATE

FRAMES_PER_SECOND = 50  # encoder positions: 1500 per 30 s
MEDIAN_FILTER_WIDTH = 7


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of the last dimension, reflecting at the edges."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = F.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect").reshape(*x.shape[:-1], -1)
    return padded.unfold(-1, width, 1).median(dim=-1).values


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest monotonic path from (0, 0) to (N-1, M-1) through an [N, M] cost matrix, moving
    down, right or diagonally; returns the (row, column) indices along it.

    Row by row: with a = the cost of arriving from above or the diagonal, the cost of cell j
    is min over k <= j of a[k] + cost[k+1..j], a running minimum of a - cumsum plus cumsum,
    so each row is a few vector operations rather than a loop over columns."""
    num_rows, num_cols = cost.shape
    previous = np.full(num_cols + 1, np.inf)
    previous[0] = 0.0
    # 0: from the diagonal, 1: from above, 2: from the left
    trace = np.empty((num_rows + 1, num_cols + 1), dtype=np.int8)
    trace[0, :] = 2
    trace[:, 0] = 1
    for i in range(1, num_rows + 1):
        row_cost = cost[i - 1]
        diagonal, above = previous[:-1], previous[1:]
        arrive = np.minimum(diagonal, above) + row_cost
        cumulative = np.cumsum(row_cost)
        shifted = arrive - cumulative
        running_min = np.minimum.accumulate(shifted)
        current = np.empty(num_cols + 1)
        current[0] = np.inf
        current[1:] = running_min + cumulative
        trace[i, 1:] = np.where(running_min < shifted, 2, np.where(diagonal < above, 0, 1))
        previous = current

    rows, cols = [], []
    i, j = num_rows, num_cols
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])


def token_times(scores: torch.Tensor, num_samples: int) -> list[float]:
    """scores [tokens, heads, 1500]: the alignment heads' pre-softmax cross-attention of the
    steps that sampled each token. Returns, for each token, the time (seconds from the piece's
    start) at which the alignment path reaches it."""
    num_frames = max(1, min(scores.shape[-1], num_samples // HOP_LENGTH // 2))
    weights = scores[..., :num_frames].float().permute(1, 0, 2).softmax(dim=-1)  # [heads, tokens, frames]
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = (weights - mean) / std.clamp_min(1e-8)
    matrix = median_filter(weights, MEDIAN_FILTER_WIDTH).mean(dim=0)  # [tokens, frames]
    rows, cols = dtw(-matrix.double().cpu().numpy())
    first_of_row = np.concatenate([[True], np.diff(rows) > 0])
    return (cols[first_of_row] / FRAMES_PER_SECOND).tolist()


def text_token_times(token_ids: list[int], scores: list[torch.Tensor], num_samples: int, eot: int) -> list[float]:
    """Times of a decode's text tokens and of its end, from the scores of the steps that
    sampled each token: the rows of the text tokens and of <|endoftext|> (which marks where the
    last word ends) go through the alignment; without an <|endoftext|>, the audio's end."""
    rows = [i for i, token in enumerate(token_ids) if token <= eot]
    if not rows:
        return []
    times = token_times(torch.stack([scores[i] for i in rows]), num_samples)
    if token_ids[-1] != eot:
        times.append(num_samples / SAMPLE_RATE)
    return times
