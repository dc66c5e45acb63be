"""Decode-load prediction: the batch a decode instance will hold when a request reaches it.

Admitting on the load now lets in every request while decode is light, though all of them
reach decode together a TTFT later, then refuses everything while they decode: prefill and
decode load swing in anti-phase (Mooncake, arXiv 2407.00079 v3, section 7). The prediction
counts instead the sequences that will still be decoding at the request's arrival there
(each running one is expected to last its mean residual output, `OutputLenEstimator`) plus
those already routed there and still in prefill that arrive before it or while it decodes.
"""

from __future__ import annotations

from typing import NamedTuple

from kvstore.scheduler.cost_model import CostModel
from kvstore.scheduler.output_len import OutputLenEstimator
from kvstore.scheduler.view import DecodeView


class DecodeLoad(NamedTuple):
    """A decode batch: how many sequences and how many KV tokens they hold."""

    num_seqs: int
    context_tokens: float

    def plus(self, input_len: int) -> DecodeLoad:
        """The batch with one more sequence of `input_len` tokens."""
        return DecodeLoad(self.num_seqs + 1, self.context_tokens + input_len)


def current_load(decode: DecodeView) -> DecodeLoad:
    """What the instance holds now."""
    return DecodeLoad(len(decode.running()), float(decode.context_tokens()))


class DecodeLoadPredictor:
    """Predicts a decode instance's batch at a future time; learns output lengths."""

    def __init__(self, cost: CostModel, outputs: OutputLenEstimator) -> None:
        self.cost = cost
        self.outputs = outputs

    def step_s(self, load: DecodeLoad) -> float:
        """Decode step time of `load`."""
        return self.cost.decode_step_s(load.num_seqs, load.context_tokens)

    def at(self, decode: DecodeView, now_s: float, at_s: float, horizon_s: float) -> DecodeLoad:
        """The batch at `at_s`: running sequences predicted to last until then (their
        context grown by the tokens generated meanwhile), plus incoming ones that arrive
        before ``at_s + horizon_s`` (while a request arriving at `at_s` decodes)."""
        running = decode.running()
        now_load = current_load(decode)
        step = max(self.step_s(now_load), self.cost.decode_step_s(1, 0))
        gap_tokens = max(0.0, at_s - now_s) / step
        num, ctx = 0, 0.0
        for seq in running:
            if self.outputs.remaining(seq.generated) > gap_tokens:
                num, ctx = num + 1, ctx + seq.context_len + gap_tokens
        for inc in decode.incoming():
            if inc.arrival_s <= at_s + horizon_s:
                num, ctx = num + 1, ctx + inc.input_len + max(0.0, at_s - inc.arrival_s) / step
        return DecodeLoad(num, ctx)

    def decode_s(self) -> float:
        """How long a new request is expected to decode for, at most (at the TBT bound)."""
        return self.outputs.mean_len

    def end_times(self, decode: DecodeView, now_s: float) -> list[float]:
        """Predicted end of each running sequence, soonest first."""
        step = max(self.step_s(current_load(decode)), self.cost.decode_step_s(1, 0))
        return sorted(now_s + self.outputs.remaining(s.generated) * step for s in decode.running())
