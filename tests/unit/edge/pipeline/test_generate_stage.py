"""``smartexit generate``'s check that the cached reference decoder is greedy decoding without a cache."""
from __future__ import annotations

import torch

from edge.model.config import preset
from edge.model.decoder import Decoder
from edge.model.exits import ExitConfig, MultiExitModel
from edge.model.reference import reference_generate
from edge.pipeline.generate import _greedy_without_cache


def _model() -> MultiExitModel:
    dec = Decoder(preset("micro"))
    dec.init_weights(0, std=0.2)  # peaked predictions: no near-ties between the two computation paths
    return MultiExitModel(dec.eval(), ExitConfig(layers=[2, 4], adapter_rank=0)).eval()


def _recomputed(model: MultiExitModel, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding recomputing the whole prefix for every token (what the one-pass check stands for)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.backbone(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_the_one_pass_check_accepts_greedy_decoding_and_rejects_any_other_token():
    m = _model()
    prompt = [3, 17, 5, 9, 11, 2]
    tokens = reference_generate(m, prompt, 12).tokens
    assert tokens == _recomputed(m, prompt, 12)
    assert _greedy_without_cache(m, prompt, tokens)
    vocab = m.backbone.cfg.vocab_size
    for i in (0, 5, 11):  # a wrong token first, in the middle, last
        wrong = list(tokens)
        wrong[i] = (wrong[i] + 1) % vocab
        assert not _greedy_without_cache(m, prompt, wrong)
