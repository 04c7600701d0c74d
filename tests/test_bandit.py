"""hpcrl's policy gradient and KL penalty on a bandit, where the exact answers are known.

One state, V arms, the policy's logits a parameter vector theta: tokens are drawn by the decode
engine's own sampling function (rl/rollout/engine.py `sample_tokens`), scored by the learner's own
log-probability function (rl/model/logprobs.py `chunked_logprobs`, the logits being theta through a
one-column "hidden state"), and pushed through the real losses (rl/learner/algorithms.py, rl/learner/reference.py).

* The mean of the policy gradient over many samples is the exact gradient of the expected reward
  under the distribution the samples were drawn from, at temperature 1, at temperature 2, and
  truncated (top-p, top-k). The exact gradient and the estimator's per-sample variance are
  computed by enumerating the arms (the kept set found here independently, with numpy), and the
  tolerance is 5 standard errors per component: seeded, and a failure would mean a bias, not bad
  luck (each component would miss with probability ~6e-7 even unseeded). The way hpcrl used to
  score hot or truncated samples (as if drawn at temperature 1) misses by tens of standard errors.
* With the KL penalty (beta > 0), training converges to the KL-regularised optimum: the
  reference without reward, pi* proportional to ref x exp(c r / beta) with reward (c = 1 - 1/G
  for group-relative advantages over groups of G: each sample's own reward is in its baseline),
  and not to the reverse KL's optimum, which the k3 loss led to.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcrl.core.config import AlgorithmConfig
from hpcrl.rl.learner.algorithms import TokenBatch, make_algorithm
from hpcrl.rl.learner.reference import kl_penalty
from hpcrl.rl.model.logprobs import Shaping, chunked_logprobs
from hpcrl.rl.rollout.engine import sample_tokens

V = 6
THETA = torch.tensor([1.2, 0.6, 0.1, -0.4, -1.0, -2.0])
REWARD = torch.tensor([0.0, 1.0, 0.3, 2.0, 0.0, 3.0])
N = 20_000  # samples per estimate: standard errors ~0.004-0.014 against gradients ~0.03-0.24


def kept_arms(theta: torch.Tensor, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """The arms a sampler keeps: the top_k largest logits, then the smallest prefix of them
    (probabilities renormalised over them) whose mass reaches top_p."""
    z = (theta / temperature).double().numpy()
    order = np.argsort(-z, kind="stable")[: top_k or V]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    keep = np.zeros(V, bool)
    mass = 0.0
    for arm, pa in zip(order, p):
        if mass >= top_p:
            break
        keep[arm] = True
        mass += pa
    return keep


def exact(temperature: float, top_p: float, top_k: int):
    """(q, J, grad J, per-component variance of one sample's gradient) for J(theta) = E_q[r],
    q the sampling distribution: softmax(theta / T) over the kept arms, whose set does not move
    with an infinitesimal change of theta. grad_j J = q_j (r_j - J) / T; one sample a gives
    g(a) = (r_a - J)(e_a - q) / T (a constant baseline J: unbiased, less variance)."""
    keep = torch.from_numpy(kept_arms(THETA, temperature, top_p, top_k))
    z = (THETA / temperature).double()
    q = torch.where(keep, torch.exp(z - z[keep].max()), torch.zeros_like(z))
    q /= q.sum()
    r = REWARD.double()
    J = float((q * r).sum())
    grad = q * (r - J) / temperature
    per_arm = (r - J)[:, None] * (torch.eye(V, dtype=torch.float64) - q) / temperature  # g(a), row a
    var = (q[:, None] * per_arm**2).sum(0) - grad**2
    return q, J, grad, var


def estimate(algorithm: str, temperature: float, top_p: float, top_k: int, as_if_temperature_1: bool = False):
    """hpcrl's policy gradient -d(loss)/d(theta), averaged over N samples drawn by the engine."""
    gen = torch.Generator().manual_seed(0)
    full = lambda v, dtype=torch.float32: torch.full((N,), v, dtype=dtype)
    shaping = Shaping(full(temperature), full(top_p), full(top_k, torch.long))
    tokens, behaviour = sample_tokens(THETA.expand(N, V), shaping.temperature, shaping.top_p, shaping.top_k, gen)
    if as_if_temperature_1:  # what hpcrl did: record and score the model's own log-probability
        behaviour = torch.log_softmax(THETA, -1)[tokens]
        shaping = Shaping(full(1.0), full(1.0), full(0, torch.long))
    weight = THETA.clone()[:, None].requires_grad_()  # logits = hidden (1) x weight^T = theta
    lp, _, _ = chunked_logprobs(torch.ones(N, 1), weight, tokens, shaping=shaping)
    _, J, _, _ = exact(temperature, top_p, top_k)
    algo = make_algorithm(AlgorithmConfig(name=algorithm, entropy_coef=0.0))
    batch = TokenBatch(
        input_ids=torch.zeros(N, 2, dtype=torch.long),
        attention_mask=torch.ones(N, 2, dtype=torch.long),
        action_mask=torch.ones(N, 1),
        behaviour_logprobs=behaviour.float()[:, None],
        advantages=(REWARD[tokens] - J).float(),
    )
    loss_sum, stats = algo.token_loss(lp[:, None], batch)
    (loss_sum / algo.denominator([1] * N)).backward()
    if not as_if_temperature_1:
        assert stats["ratio_sum"] == pytest.approx(N, rel=1e-5)  # on-policy: every ratio is 1
    return -weight.grad[:, 0].double()


@pytest.mark.parametrize("algorithm", ["grpo", "decoupled_ppo", "reinforce"])
@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 0), (2.0, 1.0, 0), (1.0, 0.7, 0), (0.8, 0.9, 3)],
    ids=["t1", "t2", "top_p0.7", "t0.8-top_p0.9-top_k3"],
)
def test_the_mean_policy_gradient_is_the_exact_gradient_of_the_sampled_distributions_reward(
    algorithm, temperature, top_p, top_k
):
    q, _, grad, var = exact(temperature, top_p, top_k)
    got = estimate(algorithm, temperature, top_p, top_k)
    tol = 5 * (var / N).sqrt() + 1e-9  # arms cut away: gradient 0, estimate exactly 0
    assert ((got - grad).abs() <= tol).all(), f"estimate {got.tolist()}\nexact {grad.tolist()}\ntol {tol.tolist()}"
    assert (got[q == 0] == 0).all()


@pytest.mark.parametrize("temperature, top_p", [(2.0, 1.0), (1.0, 0.7)])
def test_scoring_hot_or_truncated_samples_as_the_models_own_is_biased(temperature, top_p):
    """The negative control: the same samples, recorded and scored at temperature 1 untruncated."""
    _, _, grad, var = exact(temperature, top_p, 0)
    got = estimate("grpo", temperature, top_p, 0, as_if_temperature_1=True)
    assert ((got - grad).abs() / (var / N).sqrt().clamp(min=1e-12)).max() > 20


REF = torch.log_softmax(torch.tensor([1.0, 0.3, -0.2, -1.0]), -1)


def train_with_kl(reward: torch.Tensor, beta: float, group: int = 8, groups: int = 64, iters: int = 300):
    """SGD on theta (4 arms, from uniform) with hpcrl's GRPO loss (group-relative advantages,
    no std normalisation) plus beta x its KL penalty to REF; samples drawn on-policy by the
    engine. Returns the policy averaged over the second half (smaller steps there)."""
    algo = make_algorithm(AlgorithmConfig(name="grpo", entropy_coef=0.0, normalize_std=False, max_ratio=4.0))
    theta = torch.zeros(4)
    gen = torch.Generator().manual_seed(0)
    n = group * groups
    mean, counted = torch.zeros(4), 0
    for it in range(iters):
        tokens, behaviour = sample_tokens(theta.expand(n, 4), None, None, None, gen)
        weight = theta.clone()[:, None].requires_grad_()
        lp, _ = chunked_logprobs(torch.ones(n, 1), weight, tokens)
        adv = algo.advantages(reward[tokens], torch.arange(n) // group)
        mask = torch.ones(n, 1)
        batch = TokenBatch(torch.zeros(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long), mask,
                           behaviour.float()[:, None], adv)  # fmt: skip
        loss_sum, _ = algo.token_loss(lp[:, None], batch)
        is_weight = torch.exp(lp.detach()[:, None] - batch.behaviour_logprobs).clamp(max=algo.cfg.max_ratio)
        kl_sum, _ = kl_penalty(lp[:, None], REF[tokens][:, None], mask, algo.token_weights(mask), is_weight)
        ((loss_sum + beta * kl_sum) / algo.denominator([1] * n)).backward()
        with torch.no_grad():
            theta -= (0.5 if it < iters // 2 else 0.15) * weight.grad[:, 0]
        if it >= iters // 2:
            mean += torch.softmax(theta, -1)
            counted += 1
    return mean / counted


def reverse_kl_optimum(reward: torch.Tensor, beta: float, c: float) -> torch.Tensor:
    """Where k3-as-a-loss leads: its expected gradient is that of KL(ref || pi), so the fixed
    point solves c pi_j (r_j - J) = beta (pi_j - ref_j) (found by iterating on the logits)."""
    pi, ref, r = REF.exp().double(), REF.exp().double(), reward.double()
    for _ in range(20_000):
        pi = torch.softmax(torch.log(pi) + 0.5 * (c * pi * (r - (pi * r).sum()) - beta * (pi - ref)), -1)
    return pi.float()


def test_the_kl_penalty_pulls_to_the_reference_and_regularises_to_the_known_optimum():
    beta, group = 0.5, 8
    without_reward = train_with_kl(torch.zeros(4), beta, group)
    assert (without_reward - REF.exp()).abs().max() < 0.02, without_reward
    reward = torch.tensor([0.0, 0.0, 0.0, 1.0])
    c = 1 - 1 / group  # E[(r_i - mean of its group) grad log pi(a_i)] = (1 - 1/G) grad E[r]
    optimum = torch.softmax(REF + c * reward / beta, -1)
    got = train_with_kl(reward, beta, group)
    assert (got - optimum).abs().max() < 0.02, (got, optimum)
    assert (got - reverse_kl_optimum(reward, beta, c)).abs().max() > 0.15  # k3's fixed point is elsewhere
