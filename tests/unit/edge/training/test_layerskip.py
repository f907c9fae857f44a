"""LayerSkip training: dropout rates, curricula, the loss, dropped layers, resume, oracle exit depth."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import edge.training.layerskip as ls
from edge.model.config import preset
from edge.model.windows import exit_metrics, stream_windows
from edge.training.config import DistillConfig
from edge.training.distill import distill_loss
from edge.core.errors import ConfigError
from edge.model.exits import ExitConfig, MultiExitModel
from edge.training.config import Curriculum, ExitWeighting, LayerSkipConfig
from edge.training.layerskip import (active_exits, early_exit_loss, exit_weights, forward_with_layer_dropout, keep_masks,
                                     layer_dropout_rates, train_layerskip)
from edge.training.losses import distill_loss_to, teacher_targets
from edge.model.decoder import Decoder


def _decoder(seed=0) -> Decoder:
    dec = Decoder(preset("micro"))  # 4 layers, vocab 256
    dec.init_weights(seed, std=0.2)
    return dec


def _cfg(**layerskip) -> DistillConfig:
    return DistillConfig(steps=4, batch_size=3, seq_len=16, lr=1e-2, freeze_backbone=False,
                         exits=ExitConfig(layers=[1, 2, 3, 4], adapter_rank=0),
                         layerskip=LayerSkipConfig(enabled=True, ckpt_every=2, **layerskip))


def test_dropout_rates_rise_with_depth_to_p_max():
    rates = layer_dropout_rates(12, 0.2)
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.2)
    assert np.all(np.diff(rates) > 0)
    assert not layer_dropout_rates(12, 0.0).any()


def test_keep_masks_depend_only_on_seed_and_step():
    rates = layer_dropout_rates(12, 0.5)
    a = keep_masks(rates, 64, seed=3, step=7)
    assert a.shape == (12, 64) and a.dtype == torch.bool
    assert torch.equal(a, keep_masks(rates, 64, seed=3, step=7))
    assert not torch.equal(a, keep_masks(rates, 64, seed=3, step=8))
    assert a[0].all()  # the first layer is never dropped
    assert keep_masks(layer_dropout_rates(12, 0.0), 64, 3, 7).all()


def test_rotational_curriculum_cycles_groups_every_period():
    exits = list(range(1, 13))
    cfg = LayerSkipConfig(curriculum=Curriculum.ROTATIONAL, rotation_groups=2, rotation_period=3)
    odd, even = [1, 3, 5, 7, 9, 11, 12], [2, 4, 6, 8, 10, 12]
    assert [active_exits(exits, s, 100, cfg) for s in (0, 2, 3, 5, 6)] == [odd, odd, even, even, odd]
    three = LayerSkipConfig(curriculum=Curriculum.ROTATIONAL, rotation_groups=3)
    assert active_exits(exits, 1, 100, three) == [2, 5, 8, 11, 12]


def test_gradual_curriculum_enables_exits_from_the_deepest_down():
    exits = list(range(1, 13))  # 11 early exits: one more every 0.5 * 120 / 12 = 5 steps (T / 2L)
    cfg = LayerSkipConfig(curriculum=Curriculum.GRADUAL, gradual_frac=0.5)
    assert active_exits(exits, 0, 120, cfg) == [12]
    assert active_exits(exits, 4, 120, cfg) == [12]
    assert active_exits(exits, 5, 120, cfg) == [11, 12]
    assert active_exits(exits, 54, 120, cfg) == list(range(2, 13))
    assert active_exits(exits, 55, 120, cfg) == exits
    assert active_exits(exits, 119, 120, cfg) == exits
    assert active_exits(exits, 0, 120, LayerSkipConfig()) == exits  # curriculum none


def test_exit_weights():
    uniform = exit_weights([3, 6, 12], 12, LayerSkipConfig(exit_loss_scale=0.5))
    assert uniform == {3: 0.5, 6: 0.5, 12: 1.0}
    paper = exit_weights(list(range(1, 13)), 12, LayerSkipConfig(exit_weighting=ExitWeighting.LAYERSKIP))
    assert sum(paper.values()) == pytest.approx(1.0) and paper[1] == 0.0
    assert paper[11] / paper[12] == pytest.approx(55 / 11)  # e~_10 = 0+1+..+10 = 55, e~_11 = L-1 = 11


def test_no_dropout_all_exits_loss_is_the_distill_loss_sum():
    """p_max=0, every exit on, uniform weights at scale 1: the multi-exit distillation loss of
    edge.training.distill (rank-0 heads = the final norm) over every exit, summed."""
    torch.manual_seed(0)
    student, teacher = _decoder(0).train(), _decoder(1).eval()
    ids = torch.randint(0, 256, (3, 16))
    y = torch.randint(0, 256, (3 * 16,))
    with torch.no_grad():
        t_logits = teacher(ids).logits.reshape(-1, 256)
        keep = keep_masks(layer_dropout_rates(4, 0.0), 3, seed=0, step=0)
        cfg = LayerSkipConfig(enabled=True)
        got, parts = early_exit_loss(student, forward_with_layer_dropout(student, ids, keep), t_logits, y,
                                     exit_weights(active_exits([1, 2, 3, 4], 0, 10, cfg), 4, cfg), 2.0, 0.7)
        ref_model = MultiExitModel(student, ExitConfig(layers=[1, 2, 3, 4], adapter_rank=0)).train()
        ref = sum(distill_loss(lg.reshape(-1, 256), t_logits, y, 2.0, 0.7) for lg in ref_model(ids).values())
    # Same decoder path (fused causal attention in train mode); the KL is summed as sum p log p -
    # sum p log q over N*V = 12k terms instead of kl_div's sum p (log p - log q): float32 rounding
    # differs by about eps32 * sqrt(N*V) ~ 1e-5 relative.
    assert torch.allclose(got, ref, rtol=5e-5, atol=0)
    assert sorted(parts) == [1, 2, 3, 4]


def test_distill_loss_to_equals_distill_loss():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(64, 256, generator=g) * 3, torch.randn(64, 256, generator=g) * 3
    y = torch.randint(0, 256, (64,), generator=g)
    for temperature, w in ((1.0, 0.5), (2.0, 0.7), (4.0, 1.0)):
        p, plogp = teacher_targets(t, temperature)
        # float32 sums over N*V = 16k terms in another order: eps32 * sqrt(16k) ~ 1.5e-5 relative
        assert torch.allclose(distill_loss_to(s, p, plogp, y, temperature, w), distill_loss(s, t, y, temperature, w),
                              rtol=5e-5, atol=1e-6)


def test_detached_head_learns_from_the_final_layer_only():
    dec = _decoder().train()
    ids = torch.randint(0, 256, (2, 16))
    t_logits = torch.randn(32, 256)
    y = torch.randint(0, 256, (32,))
    hidden = forward_with_layer_dropout(dec, ids, torch.ones(4, 2, dtype=torch.bool))
    loss, _ = early_exit_loss(dec, hidden, t_logits, y, {2: 1.0, 4: 0.0}, 2.0, 0.7, head_grad_from_exits=False)
    loss.backward()
    assert dec.norm.weight.grad is None or not dec.norm.weight.grad.any()
    assert dec.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0  # the layers below exit 2 learn
    assert dec.layers[3].mlp.up_proj.weight.grad is None or not dec.layers[3].mlp.up_proj.weight.grad.any()


def test_dropped_layer_passes_its_input_through():
    dec = _decoder().train()
    ids = torch.randint(0, 256, (3, 16))
    keep = torch.ones(4, 3, dtype=torch.bool)
    keep[2, 0] = False  # layer 3 skipped for sample 0
    keep[3, :] = False  # layer 4 skipped for everyone
    with torch.no_grad():
        hidden = forward_with_layer_dropout(dec, ids, keep)
        full = forward_with_layer_dropout(dec, ids, torch.ones(4, 3, dtype=torch.bool))
        cos, sin = dec.rope(torch.arange(16).unsqueeze(0))
        alone = dec.layers[2](hidden[2][1:2], cos, sin, None, None, None)[0]
    assert torch.equal(hidden[3][0], hidden[2][0])
    assert torch.equal(hidden[4], hidden[3])
    assert not torch.equal(hidden[3][1], hidden[2][1])
    # A kept sample is computed as in a smaller batch: same rows, float32 path of one sequence.
    assert torch.allclose(hidden[3][1:2], alone, rtol=1e-5, atol=1e-5)
    assert torch.allclose(hidden[3][1:], full[3][1:], rtol=1e-5, atol=1e-5)
    assert len(hidden) == 5


def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    tokens = np.random.default_rng(0).integers(0, 256, 2000)
    cfg = _cfg(p_max=0.4, curriculum=Curriculum.ROTATIONAL)
    straight = _decoder()
    log_a = train_layerskip(straight, _decoder(1), tokens, cfg, tmp_path / "a")

    real = ls.random_windows

    def interrupted(data, seed, step, *args):
        if step == 3:  # killed in the fourth step: the third was done but not checkpointed (every 2)
            raise KeyboardInterrupt
        return real(data, seed, step, *args)

    monkeypatch.setattr(ls, "random_windows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_layerskip(_decoder(), _decoder(1), tokens, cfg, tmp_path / "b")
    monkeypatch.setattr(ls, "random_windows", real)
    resumed = _decoder()
    log_b = train_layerskip(resumed, _decoder(1), tokens, cfg, tmp_path / "b")
    assert [r["loss"] for r in log_b] == [r["loss"] for r in log_a]
    assert [r["exits"] for r in log_b] == [r["exits"] for r in log_a]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(r["kept"] < 1 for r in log_a)  # layers were dropped, so the masks were replayed too
    with pytest.raises(ConfigError, match="another recipe"):
        train_layerskip(_decoder(), _decoder(1), tokens, _cfg(p_max=0.1), tmp_path / "b")


def test_layerskip_config_validation():
    with pytest.raises(ConfigError, match="adapter_rank=0"):
        DistillConfig(freeze_backbone=False, layerskip=LayerSkipConfig(enabled=True))
    with pytest.raises(ConfigError, match="p_max"):
        LayerSkipConfig(p_max=1.0)
    assert LayerSkipConfig(curriculum="gradual").curriculum is Curriculum.GRADUAL


def test_oracle_exit_depth_is_the_first_exit_from_which_all_later_agree():
    model = MultiExitModel(_decoder().eval(), ExitConfig(layers=[1, 2, 3, 4], adapter_rank=0))
    tokens = np.random.default_rng(1).integers(0, 256, 3 * 16 + 1)
    m = exit_metrics(model, stream_windows(tokens, seq_len=16, max_windows=3))
    hist = m["oracle_exit_hist"]
    assert sum(hist.values()) == pytest.approx(1.0)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens[:48].astype(np.int64)).view(3, 16))
    tops = torch.stack([logits[k].argmax(-1).reshape(-1) for k in (1, 2, 3, 4)])  # [4, N]
    want = [next(i for i in range(4) if (tops[i:] == tops[3]).all(0)[n]) for n in range(48)]
    assert hist == {str(k): want.count(i) / 48 for i, k in enumerate((1, 2, 3, 4))}
    assert m["oracle_mean_exit_layer"] == pytest.approx(np.mean(want) + 1)
    assert hist["1"] <= m["exit_agreement"]["1"]
