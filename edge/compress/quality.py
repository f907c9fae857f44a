"""How far a compressed multi-exit model is from the full-precision one, teacher-forced on held-out
windows: next-token accuracy and perplexity of the last exit, each exit's agreement with the last
layer, and the KL divergence of each exit from the same exit of the reference."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from edge.model.exits import MultiExitModel


@dataclass
class Quality:
    tokens: int
    nll: float  # mean next-token negative log-likelihood of the last exit (nats)
    perplexity: float
    top1: float  # next-token accuracy of the last exit
    exit_agreement: dict[int, float]  # exit k's argmax == this model's last-layer argmax
    agreement_vs_reference: dict[int, float]  # exit k's argmax == the reference model's last-layer argmax
    kl_vs_reference: dict[int, float]  # mean KL(reference exit k || this exit k), nats per token

    def to_dict(self) -> dict:
        return {k: ({str(e): x for e, x in v.items()} if isinstance(v, dict) else v) for k, v in asdict(self).items()}


class Reference:
    """The reference model's log-probabilities of every exit on fixed windows, computed once."""

    def __init__(self, model: MultiExitModel, windows: torch.Tensor, batch: int = 8) -> None:
        self.windows, self.batch = windows, batch
        with torch.no_grad():
            self.logp = [{k: F.log_softmax(v.float(), -1) for k, v in model.eval()(windows[i:i + batch]).items()}
                         for i in range(0, len(windows), batch)]


@torch.no_grad()
def evaluate(model: MultiExitModel, ref: Reference) -> Quality:
    """Quality of ``model`` on ``ref``'s windows (the reference itself scores KL 0 and agreement 1)."""
    model = model.eval()
    last = model.exit_layers[-1]
    nll = correct = n = 0.0
    agree = {k: 0.0 for k in model.exit_layers}
    agree_ref = {k: 0.0 for k in model.exit_layers}
    kl = {k: 0.0 for k in model.exit_layers}
    for i, ref_logp in zip(range(0, len(ref.windows), ref.batch), ref.logp):
        ids = ref.windows[i:i + ref.batch]  # [B, T]
        out = {k: F.log_softmax(v.float(), -1) for k, v in model(ids).items()}  # {exit: [B, T, V]}
        target = ids[:, 1:]
        lp = out[last][:, :-1]
        nll += float(-lp.gather(-1, target.unsqueeze(-1)).sum())
        correct += float((lp.argmax(-1) == target).sum())
        n += target.numel()
        final = out[last].argmax(-1)
        ref_final = ref_logp[last].argmax(-1)
        for k in model.exit_layers:
            top = out[k].argmax(-1)
            agree[k] += float((top == final).sum())
            agree_ref[k] += float((top == ref_final).sum())
            kl[k] += float((ref_logp[k].exp() * (ref_logp[k] - out[k])).sum())
    tokens = int(ref.windows.numel())
    mean_nll = nll / max(n, 1)
    return Quality(tokens=int(n), nll=mean_nll, perplexity=math.exp(mean_nll), top1=correct / max(n, 1),
                   exit_agreement={k: v / tokens for k, v in agree.items()},
                   agreement_vs_reference={k: v / tokens for k, v in agree_ref.items()},
                   kl_vs_reference={k: v / tokens for k, v in kl.items()})
