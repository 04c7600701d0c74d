"""Batched sampling to completion, returning every sampled token's log-probability.

    sampler = Sampler(policy, seed=0)
    out = sampler.sample([[1, 40, 41], [1, 42]], max_new=[1, 64], stops=[(), ("# end",)])
    out[1].tokens, out[1].logprobs, out[1].text, out[1].finish   # finish: eos | stop | length

The rows go through rl/rollout/engine.py's continuous-batching engine (prefilled together, decoded
token by token with the KV cache, each leaving the batch when it finishes). Positions count
real tokens only (as `token_logprobs` does), so the learner recomputes the same
log-probabilities from the same tokens. Sampling is from the model's own
distribution (temperature 1): the recorded log-probabilities are exactly the behaviour
policy's, which the learner's importance ratio needs. Text is exact: an action's text is its
tokens decoded in the company of the context before them, and stop strings are matched on
text produced incrementally (`IncrementalText`), never on tokens decoded one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.engine import DecodeEngine, IncrementalText, Sample, SamplingSpec

__all__ = ["Sample", "Sampler", "IncrementalText"]


class Sampler:
    """A batch of contexts sampled to completion: `DecodeEngine` (rl/rollout/engine.py) run until done."""

    def __init__(self, policy: Policy, seed: int):
        self.policy = policy
        self.engine = DecodeEngine(policy, seed)

    @torch.no_grad()
    def sample(
        self, contexts: Sequence[Sequence[int]], max_new: Sequence[int], stops: Sequence[tuple[str, ...]]
    ) -> list[Sample]:
        n = len(contexts)
        if not (n == len(max_new) == len(stops)):
            raise ValueError(f"Sampler.sample: {n} contexts, {len(max_new)} max_new, {len(stops)} stops; need one each")
        if n and min(len(c) for c in contexts) == 0:
            raise ValueError("Sampler.sample: every context needs at least one token (e.g. bos)")
        for i in range(n):
            self.engine.submit(i, contexts[i], max_new[i], SamplingSpec(stops=tuple(stops[i])), keep=False)
        out: dict[int, Sample] = {}
        while self.engine.busy:
            out.update(self.engine.step())
        return [out[i] for i in range(n)]
