"""Exit-depth predictors: EMA arithmetic, prompt features by hand, the ridge fit against sklearn, the
request-level split (no leak), and on synthetic traces with a latent easiness the expected ordering
(prompt model beats the global mean at admission; EMA beats it per token; combined beats both)."""
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.core.errors import ConfigError
from scheduler.control.predictor import (FEATURES, HEAD, EmaPredictor, ExitDepthPredictor, PromptFeatureModel,
                                 evaluate_predictors, prompt_features, read_exit_traces, ridge_fit)

LAYERS = np.array([3, 9, 12])   # the tiny model's exits


def make_traces(n: int, seed: int = 0, tokens: tuple[int, int] = (4, 16)) -> list[dict]:
    """Requests whose exits follow a latent easiness e = 0.6 * shown + 0.4 * hidden: ``shown`` drives the
    prompt (copied spans, small ids), ``hidden`` does not, so the prompt explains only part of a request's
    depth and its own exits the rest. Exits are sticky (a token repeats the previous exit half the time)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shown, hidden = rng.uniform(), rng.uniform()
        e = 0.6 * shown + 0.4 * hidden
        plen = int(rng.integers(16, 400))
        ids: list[int] = []
        for j in range(min(plen, HEAD)):
            if j >= 8 and rng.uniform() < 0.7 * shown:
                ids.append(ids[j - 8])                     # a copied span: repeated pairs
            elif rng.uniform() < 0.6 * shown:
                ids.append(int(rng.integers(0, 256)))     # byte-level / frequent pieces
            else:
                ids.append(int(rng.integers(256, 32000)))
        p = np.clip([0.1 + 0.7 * e, 0.5 - 0.2 * e, 0.4 - 0.5 * e], 0.02, None)
        p /= p.sum()
        layers: list[int] = []
        for _ in range(int(rng.integers(*tokens))):
            sticky = layers and rng.uniform() < 0.5
            layers.append(layers[-1] if sticky else int(rng.choice(LAYERS, p=p)))
        out.append({"prompt_len": plen, "prompt_ids_head": ids, "exit_layers": layers, "exits_allowed": []})
    return out


# --- EMA ------------------------------------------------------------------------------------------------

def test_ema_update_and_run():
    ema = EmaPredictor(weight=0.25, prior=8.0)
    assert ema.update(8.0, 12) == 9.0
    np.testing.assert_allclose(ema.run([12, 3, 3]), [8.0, 9.0, 9.0 + 0.25 * (3 - 9.0)])
    np.testing.assert_allclose(ema.run([12, 3], start=3.0), [3.0, 5.25])
    np.testing.assert_array_equal(EmaPredictor(weight=1.0, prior=7.0).run([3, 12, 9]), [7.0, 3, 12])
    assert EmaPredictor(prior=5.0).weight == 0.3


@given(st.floats(0.01, 1.0), st.floats(0, 20), st.lists(st.sampled_from([3, 9, 12]), min_size=1, max_size=40))
def test_ema_stays_between_prior_and_layers(weight, prior, layers):
    pred = EmaPredictor(weight=weight, prior=prior).run(layers)
    lo, hi = min(prior, *layers), max(prior, *layers)
    assert np.all(pred >= lo - 1e-9) and np.all(pred <= hi + 1e-9)


@pytest.mark.parametrize("kw", [{"weight": 0.0, "prior": 1.0}, {"weight": 1.5, "prior": 1.0},
                                {"weight": 0.3, "prior": float("nan")}])
def test_ema_bad_parameters(kw):
    with pytest.raises(ConfigError, match="EMA predictor"):
        EmaPredictor(**kw)


# --- prompt features and the ridge fit ------------------------------------------------------------------

def test_prompt_features_by_hand():
    ids = [5, 7, 5, 7, 300, 5]          # pairs (5,7) (7,5) (5,7)* (7,300) (300,5): one of five repeats
    f = dict(zip(FEATURES, prompt_features(ids, prompt_len=100)))
    assert f["log_prompt_len"] == pytest.approx(np.log(100))
    assert f["bigram_repeat_share"] == pytest.approx(1 / 5)
    assert f["unique_ratio"] == pytest.approx(3 / 6)
    assert f["mean_log1p_id"] == pytest.approx(np.mean(np.log1p(ids)))
    assert f["share_below_256"] == pytest.approx(5 / 6)
    assert prompt_features([9])[1] == 0.0 and prompt_features([9])[0] == 0.0   # one id: no pairs; log 1


def test_features_read_only_the_head():
    ids = list(range(1000))
    np.testing.assert_array_equal(prompt_features(ids), prompt_features(ids[:HEAD], prompt_len=1000))
    with pytest.raises(ConfigError, match="no ids"):
        prompt_features([])
    with pytest.raises(ConfigError, match="shorter than"):
        prompt_features([1, 2, 3], prompt_len=2)


def test_ridge_matches_sklearn():
    from sklearn.linear_model import Ridge
    traces = make_traces(200, seed=1)
    X = np.stack([prompt_features(t["prompt_ids_head"], t["prompt_len"]) for t in traces])
    y = np.array([np.mean(t["exit_layers"]) for t in traces])
    for alpha in (0.0, 1.0, 30.0):
        m = PromptFeatureModel(alpha=alpha).fit(traces)
        ref = Ridge(alpha=alpha).fit((X - X.mean(0)) / X.std(0), y)
        # both solve the same 5 x 5 float64 system: agreement ~ eps64 * cond (standardized: small)
        np.testing.assert_allclose(m.coef, ref.coef_, rtol=1e-7, atol=1e-9)
        assert m.intercept == pytest.approx(ref.intercept_, rel=1e-12)


def test_ridge_recovers_a_linear_target_and_the_model_clips():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(80, 5)) * [1, 10, 0.1, 3, 1] + [0, 5, 1, 2, 0]
    X[:, 4] = 0.5                                      # a constant feature: scale 1, coefficient 0
    w = np.array([0.5, 2.0, -1.0, 0.3, 0.0])
    mean, scale, coef, intercept = ridge_fit(X, X @ w + 4.0, alpha=0.0)
    # noiseless least squares: exact up to float64 rounding of a well-conditioned 5 x 5 solve
    np.testing.assert_allclose(intercept + ((X - mean) / scale) @ coef, X @ w + 4.0, rtol=1e-10)
    assert coef[4] == 0.0 and scale[4] == 1.0
    m = PromptFeatureModel().fit(make_traces(50, seed=2))
    far = m.predict_raw([1] * 64, 10 ** 12)           # far outside the fit's prompt lengths
    assert m.predict([1] * 64, 10 ** 12) == min(m.hi, max(m.lo, far)) and m.lo <= m.predict([1] * 64, 10 ** 12) <= m.hi
    assert 3 <= m.lo < m.hi <= 12


def test_model_round_trips_through_json():
    m = PromptFeatureModel(alpha=2.0).fit(make_traces(60, seed=3))
    d = json.loads(json.dumps(m.to_dict()))
    back = PromptFeatureModel.from_dict(d)
    ids = list(range(40, 140))
    assert back.predict(ids) == m.predict(ids)
    c = ExitDepthPredictor(m, weight=0.4)
    c2 = ExitDepthPredictor.from_dict(json.loads(json.dumps(c.to_dict())))
    assert c2.weight == 0.4 and c2.admit(ids) == c.admit(ids)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("coef"), "field 'coef' is missing"),
    (lambda d: d.update(coef=[1.0, 2.0]), "field 'coef' must hold 5 numbers"),
    (lambda d: d.update(mean=["a"] * 5), "not numeric"),
    (lambda d: d.update(features=["x"]), "saved for features"),
    (lambda d: d.update(kind="forest"), "expected a dict with kind"),
])
def test_model_from_bad_dict(change, message):
    d = PromptFeatureModel().fit(make_traces(20)).to_dict()
    change(d)
    with pytest.raises(ConfigError, match=message):
        PromptFeatureModel.from_dict(d)


def test_unfitted_model_says_so():
    with pytest.raises(ConfigError, match="not fitted"):
        PromptFeatureModel().predict([1, 2])
    with pytest.raises(ConfigError, match="not fitted"):
        PromptFeatureModel().to_dict()


# --- combined -------------------------------------------------------------------------------------------

def test_combined_starts_from_the_prompt_model_then_follows_the_exits():
    m = PromptFeatureModel().fit(make_traces(50, seed=4))
    c = ExitDepthPredictor(m, weight=0.5)
    t = {"prompt_len": 120, "prompt_ids_head": list(range(64)), "exit_layers": [12, 3]}
    start = m.predict(t["prompt_ids_head"], 120)
    assert c.admit(t["prompt_ids_head"], 120) == start
    np.testing.assert_allclose(c.run(t), [start, (start + 12) / 2])
    assert c.update(4.0, 12) == 8.0


# --- evaluation -----------------------------------------------------------------------------------------

def test_evaluation_splits_by_request_without_leak(monkeypatch):
    """Fit sees exactly the training requests (a spy on fit), the global mean comes from them alone, and
    the two id sets are disjoint and cover every trace."""
    traces = make_traces(100, seed=5)
    fitted = []
    orig = PromptFeatureModel.fit
    monkeypatch.setattr(PromptFeatureModel, "fit", lambda self, ts: (fitted.extend(ts), orig(self, ts))[1])
    r = evaluate_predictors(traces, holdout=0.3, seed=1)
    train, test = set(r["train_ids"]), set(r["test_ids"])
    assert not train & test and train | test == set(range(100)) and len(test) == 30
    assert {id(t) for t in fitted} == {id(traces[i]) for i in train}
    assert r["global_mean"]["token"] == pytest.approx(np.mean(np.concatenate([traces[i]["exit_layers"] for i in train])))
    assert r["requests"] == {"train": 70, "test": 30}
    assert r["tokens"]["test"] == sum(len(traces[i]["exit_layers"]) for i in test)
    assert evaluate_predictors(traces, seed=1)["test_ids"] == r["test_ids"]      # seeded
    assert evaluate_predictors(traces, seed=2)["test_ids"] != r["test_ids"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predictors_order_on_traces_with_latent_easiness(seed):
    r = evaluate_predictors(make_traces(300, seed=seed), holdout=0.3, seed=seed)
    tok, req = r["token_mae"], r["request_mae"]
    assert req["prompt_model"] < 0.95 * req["global_mean"], req     # the prompt shows part of the depth
    assert tok["ema"] < 0.9 * tok["global_mean"], tok              # a request's exits show it
    assert tok["combined"] < tok["ema"] and tok["combined"] < tok["prompt_model"], tok


def test_no_signal_no_gain():
    """Exits independent of everything: nothing beats the global mean by more than noise."""
    rng = np.random.default_rng(0)
    traces = [{"prompt_len": 64, "prompt_ids_head": rng.integers(0, 32000, 64).tolist(),
               "exit_layers": rng.choice(LAYERS, 20).tolist()} for _ in range(300)]
    r = evaluate_predictors(traces, seed=0)
    assert r["request_mae"]["prompt_model"] > 0.9 * r["request_mae"]["global_mean"]
    assert r["token_mae"]["ema"] > r["token_mae"]["global_mean"]   # chasing noise costs


# --- bad input ------------------------------------------------------------------------------------------

GOOD = {"prompt_len": 3, "prompt_ids_head": [1, 2, 3], "exit_layers": [3, 9]}


@pytest.mark.parametrize("trace, message", [
    ({k: v for k, v in GOOD.items() if k != "exit_layers"}, r"exit trace 1: 'exit_layers' is missing"),
    (dict(GOOD, exit_layers=[]), r"exit trace 1: 'exit_layers' must be a non-empty list"),
    (dict(GOOD, exit_layers=[3, "9"]), r"exit trace 1: 'exit_layers' must hold ints >= 0, got '9'"),
    (dict(GOOD, exit_layers=[3, -1]), r"'exit_layers' must hold ints >= 0, got -1"),
    (dict(GOOD, prompt_ids_head=[]), r"'prompt_ids_head' must be a non-empty list"),
    (dict(GOOD, prompt_ids_head=[1, 2.5]), r"'prompt_ids_head' must hold ints >= 0, got 2.5"),
    (dict(GOOD, prompt_len=0), r"'prompt_len' must be an int >= 1, got 0"),
    (dict(GOOD, prompt_len=True), r"'prompt_len' must be an int >= 1"),
    (dict(GOOD, prompt_len=2), r"'prompt_ids_head' holds 3 ids, more than prompt_len 2"),
    ([1, 2], r"exit trace 1: expected an object, got list"),
])
def test_bad_traces_name_index_and_key(trace, message):
    with pytest.raises(ConfigError, match=message):
        evaluate_predictors([GOOD, trace] + [GOOD] * 20)


@pytest.mark.parametrize("traces, kw, message", [
    ([], {}, r"0 traces .* need >= 6 to fit and >= 1 to test"),
    ([GOOD] * 7, {}, r"7 traces with holdout 0.3 leave 5 to fit and 2 to test"),
    ([GOOD] * 10, {"holdout": 0.01}, r"leave 10 to fit and 0 to test"),
    ([GOOD] * 10, {"holdout": 1.0}, r"holdout must be in \(0, 1\)"),
    ({"a": GOOD}, {}, r"expected a list of traces, got dict"),
])
def test_too_few_or_bad_arguments(traces, kw, message):
    with pytest.raises(ConfigError, match=message):
        evaluate_predictors(traces, **kw)


def test_fit_needs_two_traces():
    with pytest.raises(ConfigError, match="at least 2 traces"):
        PromptFeatureModel().fit([GOOD])
    with pytest.raises(ConfigError, match="alpha must be >= 0"):
        PromptFeatureModel(alpha=-1.0).fit([GOOD, GOOD])


def test_read_exit_traces(tmp_path):
    p = tmp_path / "exit_traces.json"
    p.write_text(json.dumps(make_traces(5)))
    assert len(read_exit_traces(p)) == 5
    with pytest.raises(ConfigError, match=r"exit traces .*nope\.json: no such file"):
        read_exit_traces(tmp_path / "nope.json")
    p.write_text("[{")
    with pytest.raises(ConfigError, match=r"exit_traces\.json: not JSON \(line 1"):
        read_exit_traces(p)
    p.write_text(json.dumps([GOOD, dict(GOOD, exit_layers=[])]))
    with pytest.raises(ConfigError, match=r"exit_traces\.json: exit trace 1: 'exit_layers'"):
        read_exit_traces(p)
