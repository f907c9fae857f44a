"""Mode exact with temperature > 0: speculative sampling (Leviathan et al. 2023; Chen et al. 2023)
outputs tokens distributed exactly as the full model's. The acceptance rule on its own, then the
engine's output (torch and ONNX Runtime backends) against the full model's exact joint distribution of
the first tokens, with a negative control that shows the test has the power to see a wrong acceptance
rule. Sampled tokens are not compared across backends: ONNX Runtime drafts from an int8 head, so its
drafts, and the random numbers they consume, differ from torch's; only the distribution is the same."""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from scipy import stats

import edge.runtime.rounds as rounds_module
from edge.runtime.backend import make_backend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Request
from edge.runtime.sampling import token_distribution
from edge.runtime.spec_accept import accept_sampled
from edge.runtime.speculative import SpecConfig
from edge.runtime.torch_backend import TorchBackend
from tests.unit.edge.runtime.test_engine import _model

torch.set_num_threads(1)  # the machine is shared; tiny models need no more (as tests/unit/exporters do)

ALPHA = 1e-3  # chi-square level; every draw is seeded, so the outcome is fixed: this says how unlucky it may be
V = 8  # vocabulary of the sampling model: the joint of 3 tokens has 512 cells
PROMPT = [1, 2, 3]
TOKENS = 3  # tokens whose joint distribution is tested
REQUESTS = 640  # sampled sequences per case, 64 decoding at once


def _chisquare(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson chi-square p-value of ``counts`` against probabilities ``expected_p`` (same shape).
    Cells expected below 5 draws are pooled into one, itself merged into the smallest cell if still
    below 5 (the usual validity condition of the chi-square approximation, Cochran 1954); a draw in a
    cell of probability 0 is a failure by itself."""
    counts, expected_p = counts.ravel(), expected_p.ravel()
    assert counts[expected_p == 0].sum() == 0, f"{counts[expected_p == 0].sum()} draws of probability 0"
    expected = counts.sum() * expected_p
    big = expected >= 5
    obs, exp = counts[big].astype(float), expected[big]
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp >= 5:
        obs, exp = np.append(obs, rest_obs), np.append(exp, rest_exp)
    else:
        smallest = int(np.argmin(exp))
        obs[smallest] += rest_obs
        exp[smallest] += rest_exp
    return float(stats.chisquare(obs, exp).pvalue)


# ------------------------------------------------------------------------------ the acceptance rule
def _random_dist(rng, v, zeros=0):
    d = rng.dirichlet(np.full(v, 0.7))
    d[rng.choice(v, zeros, replace=False)] = 0.0
    return d / d.sum()


@pytest.mark.parametrize("zeros", [0, 2], ids=["full_support", "disjoint_zeros"])
def test_accept_sampled_outputs_the_target_distribution(zeros):
    """Drafts x1 ~ q[0], x2 ~ q[1]; p[0], p[1], p[2] fixed (in this unit test the target does not depend
    on the prefix). The first output token (x1 if accepted, else the residual draw) is distributed as
    p[0]; given the first draft accepted, the second as p[1]; given both accepted, the bonus token as
    p[2]. With ``zeros``, p and q each miss tokens the other has (top-p truncation)."""
    rng = np.random.default_rng(zeros)
    v, n = 5, 20_000
    q = [_random_dist(rng, v, zeros) for _ in range(2)]
    p = [_random_dist(rng, v, zeros) for _ in range(3)]
    draws = np.random.default_rng(100 + zeros)
    first, second, bonus = np.zeros(v, int), np.zeros(v, int), np.zeros(v, int)
    for _ in range(n):
        drafts = [int(draws.choice(v, p=q[0])), int(draws.choice(v, p=q[1]))]
        k, token = accept_sampled(drafts, q, p, draws)
        out = drafts[:k] + [token]
        first[out[0]] += 1
        if k >= 1:
            second[out[1]] += 1
        if k == 2:
            bonus[out[2]] += 1
    assert _chisquare(first, p[0]) > ALPHA
    assert _chisquare(second, p[1]) > ALPHA
    assert _chisquare(bonus, p[2]) > ALPHA
    assert second.sum() > 2000 and bonus.sum() > 500  # both later positions were reached often


def test_accept_sampled_edge_cases():
    rng = np.random.default_rng(0)
    q = [np.array([0.5, 0.5, 0.0])] * 2
    # p == q: nothing is ever rejected, the bonus comes from the last p
    last = np.array([0.0, 0.0, 1.0])
    assert all(accept_sampled([0, 1], q, q + [last], rng) == (2, 2) for _ in range(200))
    # p gives the draft probability 0: rejected, and the residual max(0, p - q) is all on token 2
    p = [np.array([0.0, 0.0, 1.0])] * 3
    assert all(accept_sampled([0, 1], q, p, rng) == (0, 2) for _ in range(200))
    # no drafts: one token from p
    assert accept_sampled([], [], [last], rng) == (0, 2)


# ----------------------------------------------------------------------------------------- the engine
@functools.lru_cache(maxsize=None)
def _sampling_model():
    """A random model over V tokens: its first exit's distribution differs from the full model's
    (drafts are accepted ~40% of the time at temperature 1), so rounds accept, reject mid-round and
    draw bonus tokens."""
    return _model(seed=3, vocab_size=V)


@torch.no_grad()
def _exact_joint(m, temperature, top_p, prompt=PROMPT) -> np.ndarray:
    """P(x1, x2, x3) [V, V, V] of full-depth sampling after ``prompt``: p(x1) p(x2 | x1) p(x3 | x1, x2), each
    factor the distribution the engine samples from (sampling.token_distribution: temperature, then
    the nucleus) of one teacher-forced forward over every continuation."""
    n = len(prompt)
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # [V * V, n + 2]
    logits = m.backbone(seqs).logits.numpy()  # [V * V, n + 2, V]

    def dist(row, pos):
        return token_distribution(logits[row, pos], temperature, top_p)

    p1 = dist(0, n - 1)
    joint = np.zeros((V, V, V))
    for a in range(V):
        p2 = dist(a * V, n)
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * dist(a * V + b, n + 1)
    return joint


def _engine_joint(eng, prompt, temperature, top_p, requests) -> np.ndarray:
    """Counts [V, V, V] of the first TOKENS tokens after ``prompt`` of ``requests`` requests (seeds 0, 1,
    ...) in mode exact on engine ``eng``, each asking one token more than tested."""
    ids = [eng.submit(Request(prompt, TOKENS + 1, temperature=temperature, top_p=top_p, seed=k,
                              mode="exact")) for k in range(requests)]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id].append(ev.token)
    counts = np.zeros((V,) * TOKENS, int)
    for toks in out.values():
        assert len(toks) == TOKENS + 1
        counts[tuple(toks[:TOKENS])] += 1
    return counts


def _sample_joint(backend, temperature, top_p, requests=REQUESTS):
    """Counts [V, V, V] of the first TOKENS tokens of ``requests`` requests in mode exact, exit drafts, 64
    decoding at once (continuous batching); each request asks one token more than tested, so its first
    round verifies two drafts. Returns (counts, the engine's SpecStats)."""
    eng = Engine(backend, EngineConfig(max_seqs=64, max_running=64, max_len=16, prefill_budget=64 * 3,
                                       speculate_max_batch=None,
                                       speculative=SpecConfig(stop="fixed", fixed=2, max_draft=2, sources=("exit",))))
    return _engine_joint(eng, PROMPT, temperature, top_p, requests), eng.spec_stats


@pytest.mark.slow  # ~10 s each (640 sampled requests); the ONNX Runtime case below stays in make test-fast
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.0, 0.8)], ids=["softmax", "top_p0.8"])
def test_exact_sampling_is_distributed_as_the_full_model(temperature, top_p):
    """Chi-square of the first three tokens' joint counts against the full model's exact joint. Seeds
    0..639: deterministic. The rounds both accepted and rejected drafts, so both branches of the rule
    shaped the counts."""
    m = _sampling_model()
    counts, st = _sample_joint(TorchBackend(m), temperature, top_p)
    pvalue = _chisquare(counts, _exact_joint(m, temperature, top_p))
    assert pvalue > ALPHA, f"p = {pvalue:.3g}"
    assert 0.1 * st.drafted < st.accepted < 0.9 * st.drafted, st.as_dict()


def _always_accept(drafts, q, p, rng):
    """A wrong acceptance rule: every draft kept, the bonus token from p (the draft's own distribution
    leaks into the output)."""
    return len(drafts), int(rng.choice(p[-1].shape[0], p=p[-1]))


def test_the_distribution_test_rejects_a_wrong_acceptance_rule(monkeypatch):
    """Negative control: the same test, on an engine whose acceptance keeps every draft, fails by far
    (so the test above passing means something), with under a third of the draws (measured: p ~ 2e-37
    with 192 draws; the per-draw chi-square distance of the two joints is ~770)."""
    monkeypatch.setattr(rounds_module, "accept_sampled", _always_accept)
    m = _sampling_model()
    counts, st = _sample_joint(TorchBackend(m), 1.0, 1.0, requests=192)
    assert st.accepted == st.drafted > 0
    assert _chisquare(counts, _exact_joint(m, 1.0, 1.0)) < ALPHA  # no draw is impossible at top_p 1: by counts


@pytest.fixture(scope="module")
def exported_sampling(tmp_path_factory):
    """The sampling model exported to ONNX Runtime (test_ort_backend's ``_export`` rounds the weights to
    fp16 in place: a copy)."""
    from tests.unit.edge.runtime.test_ort_backend import _export

    return _export(tmp_path_factory.mktemp("ort_sampling"), copy.deepcopy(_sampling_model()))


def test_exact_sampling_on_onnx_runtime_is_distributed_as_the_full_model(exported_sampling):
    """On ONNX Runtime the drafts come from the export's int8 draft head, so the draft distribution q is
    not torch's; speculative sampling is exact for any q, as long as q is the distribution each draft
    was drawn from. The same chi-square against the (fp16-rounded) model's exact joint."""
    m, ckpt, graphs = exported_sampling
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    counts, st = _sample_joint(backend, 1.0, 1.0)
    pvalue = _chisquare(counts, _exact_joint(m, 1.0, 1.0))
    assert pvalue > ALPHA, f"p = {pvalue:.3g}"
    assert 0.1 * st.drafted < st.accepted < 0.9 * st.drafted, st.as_dict()
