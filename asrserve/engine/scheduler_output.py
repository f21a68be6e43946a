"""What one engine step runs: the scheduler's decision, which the model runner executes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asrserve.engine.request import Request


@dataclass
class SchedulerOutput:
    # Every request in this step's decoder forward, in batch order.
    scheduled: list[Request] = field(default_factory=list)
    # Requests admitted this step: their audio goes through one encoder forward and their
    # cross-attention K/V is written before the decoder runs.
    encoder_requests: list[Request] = field(default_factory=list)
    # Encoder outputs the runner may now drop (freed by the scheduler one step earlier).
    freed_encoder_ids: list[str] = field(default_factory=list)
    # Sequences preempted or siblings dropped for blocks this step.
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.freed_encoder_ids
