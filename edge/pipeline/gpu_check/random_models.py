"""Random-weight models of real shapes in bf16 for deploy/gpu_check.py's timings (weights do not change a
step's time): any ``ModelConfig`` with exits where asked, and Llama-3.1-8B's shape with exits after 8, 16, 24."""
from __future__ import annotations


def random_model(cfg, exits: list[int], dev, shortlist: int = 0):
    """A random-weight model of shape ``cfg`` in bf16 on ``dev`` (std 0.02, norms 1), exits after ``exits``
    (norm + shared head; a ``shortlist`` of candidate ids 0..K-1 where asked: all timing needs)."""
    import torch

    from edge.model.decoder import Decoder
    from edge.model.exits import ExitConfig, MultiExitModel

    torch.manual_seed(0)
    with torch.device(dev):
        dec = Decoder(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model = MultiExitModel(dec.eval(), ExitConfig(layers=[*exits, cfg.num_layers], adapter_rank=0, shortlist=shortlist))
    return model.to(device=dev, dtype=torch.bfloat16).eval()  # the exit norms too (their weights are float32 when made)


def llama8b_shape(dev):
    """A random-weight model of Llama-3.1-8B's shape in bf16 with exits after 8, 16, 24 (norm + shared head)."""
    from edge.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, max_position_embeddings=8192)
    return random_model(cfg, [8, 16, 24], dev)
