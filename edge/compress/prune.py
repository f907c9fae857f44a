"""Progressive structured pruning of MLP neurons and query heads in the layers just before each exit.

The layers that feed a decision exit decide how much an early exit costs, so they are the ones made
smaller. Each step measures importance on calibration windows, physically removes that step's share
(the ``nn.Linear`` matrices get smaller) and recovers with a short distillation from the unpruned
teacher (KL of every exit to the teacher's same exit; only the pruned layers train). Gradual pruning
with recovery in between follows Zhu & Gupta 2017; structured LLM pruning with short recovery follows
LLM-Pruner (Ma et al. 2023).

Importance of a unit (an MLP neuron i, or a query head h):
  magnitude: mean over tokens of the norm of what the unit adds to the residual stream,
             |silu(gate_i) * up_i| * ||down[:, i]|| for a neuron, ||a_h @ o_proj[:, h]^T|| for a head.
  taylor:    mean over tokens of |a * dL/da| (Molchanov et al. 2017), summed over the head's
             dimensions for a head (Michel et al. 2019): the first-order change of L when the unit
             is removed. L is next-token cross-entropy averaged over exits, not the KL to the
             teacher: the first step starts at student == teacher, where the KL and its gradient are 0.

Only query heads are removed, the same number in every KV group, so K/V (and the KV cache) keep
their shape and GQA stays uniform (the runtime's GroupQueryAttention op still applies).
"""
from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from edge.core.errors import CheckpointError, ConfigError
from edge.model.decoder import MLP, Attention, Decoder, attention_mask
from edge.model.exits import MultiExitModel


class Importance(str, enum.Enum):
    MAGNITUDE = "magnitude"
    TAYLOR = "taylor"


@dataclass
class PruneConfig:
    """How much to prune near the exits, how to rank units, how to recover."""

    layers_before_exit: int = 1  # pruned layers per decision exit: exit k (1-based) -> layers k-1, k-2, .. (0-based)
    mlp_fraction: float = 0.25  # share of MLP neurons removed in each pruned layer, after all steps
    heads_per_group: int = 0  # query heads removed per KV group in each pruned layer, after all steps
    importance: Importance = Importance.MAGNITUDE
    steps: int = 2  # progressive: the removal is spread over this many equal steps
    recovery_steps: int = 20  # distillation steps after each pruning step
    calib_batches: int = 2  # batches the importance is averaged over, each step
    lr: float = 3e-4
    batch_size: int = 4
    seq_len: int = 128
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            self.importance = Importance(self.importance)
        except ValueError:
            raise ConfigError(f"prune.importance must be one of {[i.value for i in Importance]}, "
                              f"got {self.importance!r}") from None
        minimum = dict(layers_before_exit=1, steps=1, calib_batches=1, batch_size=1, heads_per_group=0,
                       recovery_steps=0, seq_len=2)  # seq_len: next-token targets need 2 tokens
        for name, low in minimum.items():
            if getattr(self, name) < low:
                raise ConfigError(f"prune.{name} must be >= {low}, got {getattr(self, name)}")
        if not 0.0 <= self.mlp_fraction < 1.0:
            raise ConfigError(f"prune.mlp_fraction must be in [0, 1), got {self.mlp_fraction}")
        if self.mlp_fraction == 0.0 and self.heads_per_group == 0:
            raise ConfigError("prune: nothing to remove (mlp_fraction = 0 and heads_per_group = 0)")
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"prune.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class LayerPrune:
    """One pruned layer (0-based), before and after."""

    layer: int
    neurons_before: int
    neurons_after: int
    heads_before: int
    heads_after: int
    params_before: int
    params_after: int


@dataclass
class PruneResult:
    importance: str
    layers: list[LayerPrune]
    params_before: int  # whole model (backbone + exit heads)
    params_after: int
    step_losses: list[list[float]]  # per pruning step, the loss of each recovery step
    shapes: dict[int, dict[str, int]]  # :func:`layer_shapes` of the pruned model
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (layer keys of ``shapes`` as strings)."""
        return {**asdict(self), "shapes": {str(k): v for k, v in self.shapes.items()}}


@dataclass
class LayerImportance:
    neurons: torch.Tensor  # [F] score of each MLP neuron (higher = keep)
    heads: torch.Tensor  # [H] score of each query head


# ---- pure helpers -------------------------------------------------------------------------------
def pruned_layers(exit_layers: list[int], layers_before_exit: int) -> list[int]:
    """0-based layers just before every decision exit (all exits but the last), clipped at layer 0."""
    out = {k - 1 - j for k in exit_layers[:-1] for j in range(layers_before_exit) if k - 1 - j >= 0}
    return sorted(out)


def schedule(total: int, steps: int) -> list[int]:
    """Units removed at each of ``steps`` steps: as equal as integers allow, summing to ``total``."""
    return [round(total * s / steps) - round(total * (s - 1) / steps) for s in range(1, steps + 1)]


def keep_top(scores: torch.Tensor, n_keep: int) -> list[int]:
    """Indices of the ``n_keep`` highest scores, in increasing order (ties keep the lower index)."""
    order = torch.sort(-scores.float(), stable=True).indices
    return sorted(order[:n_keep].tolist())


def keep_heads_per_group(scores: torch.Tensor, num_kv_heads: int, n_remove: int) -> list[int]:
    """Query heads kept when the ``n_remove`` lowest-scoring heads of every KV group go.
    scores [H]; heads are grouped consecutively (GQA: group g = heads g*rep .. g*rep+rep-1)."""
    rep = scores.numel() // num_kv_heads
    return [g * rep + i for g in range(num_kv_heads) for i in keep_top(scores[g * rep:(g + 1) * rep], rep - n_remove)]


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- physical removal ---------------------------------------------------------------------------
def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of w [out, in] and b [out]."""
    lin = nn.utils.skip_init(nn.Linear, w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def _check_index(idx: list[int], n: int, what: str) -> torch.Tensor:
    if not idx or len(set(idx)) != len(idx) or min(idx) < 0 or max(idx) >= n:
        raise ConfigError(f"{what}: keep indices must be distinct, non-empty and in [0, {n}), got {idx}")
    return torch.tensor(sorted(idx), dtype=torch.long)


def prune_mlp(mlp: MLP, keep_idx: list[int]) -> None:
    """Keep only neurons ``keep_idx`` of a SwiGLU MLP: rows of gate/up, columns of down (in place)."""
    keep = _check_index(list(keep_idx), mlp.gate_proj.out_features, "prune_mlp").to(mlp.gate_proj.weight.device)
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    mlp.gate_proj = _linear(g.weight[keep], None if g.bias is None else g.bias[keep])
    mlp.up_proj = _linear(u.weight[keep], None if u.bias is None else u.bias[keep])
    mlp.down_proj = _linear(d.weight[:, keep], d.bias)  # the output bias is not per neuron


def prune_heads(attn: Attention, keep_heads: list[int]) -> None:
    """Keep only query heads ``keep_heads`` (the same number in every KV group; in place).

    Removes the heads' rows of q_proj and columns of o_proj and sets ``attn.num_heads``. Kept heads
    stay in order, so group g's survivors are again consecutive and still read KV head g.
    """
    h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    keep = _check_index(list(keep_heads), h, "prune_heads")
    rep = h // kvh
    per_group = torch.bincount(keep // rep, minlength=kvh)
    if not bool((per_group == per_group[0]).all()):
        raise ConfigError(f"prune_heads: every KV group must keep the same number of query heads, "
                          f"got {per_group.tolist()} per group for heads {keep.tolist()}")
    cols = (keep[:, None] * hd + torch.arange(hd)).reshape(-1).to(attn.q_proj.weight.device)  # [H' * hd]
    q, o = attn.q_proj, attn.o_proj
    attn.q_proj = _linear(q.weight[cols], None if q.bias is None else q.bias[cols])
    attn.o_proj = _linear(o.weight[:, cols], o.bias)
    attn.num_heads = keep.numel()


# ---- shapes of a pruned checkpoint --------------------------------------------------------------
def _backbone(model: Decoder | MultiExitModel) -> Decoder:
    return model.backbone if isinstance(model, MultiExitModel) else model


def layer_shapes(model: Decoder | MultiExitModel) -> dict[int, dict[str, int]]:
    """{0-based layer: {"intermediate_size": F, "num_heads": H}} for what differs from the config."""
    dec = _backbone(model)
    out: dict[int, dict[str, int]] = {}
    for i, layer in enumerate(dec.layers):
        entry = {}
        if layer.mlp.gate_proj.out_features != dec.cfg.intermediate_size:
            entry["intermediate_size"] = layer.mlp.gate_proj.out_features
        if layer.self_attn.num_heads != dec.cfg.num_heads:
            entry["num_heads"] = layer.self_attn.num_heads
        if entry:
            out[i] = entry
    return out


def apply_shapes(model: Decoder | MultiExitModel, shapes: dict[Any, dict[str, int]]) -> None:
    """Resize the layers of a freshly built model to ``shapes`` (weights left uninitialised), so that a
    pruned ``state_dict`` loads into it. Keys may be ints or strings (as read back from JSON).

    Raises:
        CheckpointError: a layer out of range, an unknown field, or a size the model cannot take.
    """
    dec = _backbone(model)
    cfg = dec.cfg
    for key, entry in shapes.items():
        i = int(key) if str(key).isdigit() else -1
        if not 0 <= i < cfg.num_layers:
            raise CheckpointError(f"pruned shapes: layer {key!r} is not one of the model's {cfg.num_layers} layers")
        if set(entry) - {"intermediate_size", "num_heads"}:
            raise CheckpointError(f"pruned shapes: layer {i} has unknown fields {sorted(set(entry))}")
        f, h = int(entry.get("intermediate_size", cfg.intermediate_size)), int(entry.get("num_heads", cfg.num_heads))
        if f < 1 or h < 1 or h % cfg.num_kv_heads:
            raise CheckpointError(f"pruned shapes: layer {i} needs intermediate_size >= 1 and num_heads a positive "
                                  f"multiple of num_kv_heads ({cfg.num_kv_heads}), got {f} and {h}")
        mlp, attn, w = dec.layers[i].mlp, dec.layers[i].self_attn, dec.layers[i].mlp.gate_proj.weight

        def empty(n_in: int, n_out: int, bias: bool) -> nn.Linear:
            return nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias, device=w.device, dtype=w.dtype)
        d, q = cfg.hidden_size, h * cfg.head_dim
        mlp.gate_proj, mlp.up_proj = empty(d, f, cfg.mlp_bias), empty(d, f, cfg.mlp_bias)
        mlp.down_proj = empty(f, d, cfg.mlp_bias)
        attn.q_proj, attn.o_proj, attn.num_heads = empty(d, q, cfg.qkv_bias), empty(q, d, cfg.o_bias), h


# ---- importance ---------------------------------------------------------------------------------
def _exit_ce(model: MultiExitModel, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over exits (the loss the Taylor scores differentiate)."""
    logits = model(ids)  # {exit: [B, T, V]}
    tgt = ids[:, 1:].reshape(-1)
    return sum(F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), tgt) for z in logits.values()) / len(logits)


def _unit_scores(kind: Importance, a: torch.Tensor, g: torch.Tensor | None, w: torch.Tensor,
                 heads: int) -> torch.Tensor:
    """Per-unit scores [U] summed over tokens.

    a [B, T, U*k]: input of down_proj (U neurons, k = 1) or of o_proj (U heads, k = head_dim);
    g: dL/da (Taylor) or None; w [D, U*k]: down_proj / o_proj weight."""
    n = a.shape[0] * a.shape[1]
    a = a.detach().reshape(n, heads, -1).float()  # [N, U, k]
    if kind is Importance.TAYLOR:
        s = (a * g.detach().reshape(n, heads, -1).float()).sum(-1).abs()  # [N, U]: |first-order change|
    else:  # ||a_u @ W_u^T|| = sqrt(a_u (W_u^T W_u) a_u^T), without forming [N, U, D]
        wu = w.detach().float().reshape(w.shape[0], heads, -1)  # [D, U, k]
        gram = torch.einsum("duk,dul->ukl", wu, wu)  # [U, k, k]
        s = torch.einsum("nuk,ukl,nul->nu", a, gram, a).clamp_min(0).sqrt()  # [N, U]
    return s.sum(0)


def measure_importance(model: MultiExitModel, layers: list[int], batches: list[torch.Tensor],
                       kind: Importance | str) -> dict[int, LayerImportance]:
    """Mean importance of every MLP neuron and query head of ``layers`` (0-based) over ``batches``
    (ids [B, T] each). Magnitude runs without gradients; Taylor backpropagates :func:`_exit_ce`
    and then clears the model's parameter gradients."""
    kind = Importance(kind)
    dec = model.backbone
    sums: dict[tuple[int, str], torch.Tensor] = {}

    def add(key: tuple[int, str], s: torch.Tensor) -> None:
        sums[key] = sums[key] + s if key in sums else s

    def hook(key: tuple[int, str], lin: nn.Linear, units: Callable[[], int]):
        def pre(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            a = args[0]
            if kind is Importance.TAYLOR:
                a.register_hook(lambda g: add(key, _unit_scores(kind, a, g, lin.weight, units())))
            else:
                add(key, _unit_scores(kind, a, None, lin.weight, units()))
        return lin.register_forward_pre_hook(pre)

    handles, flags = [], {}
    for i in layers:
        layer = dec.layers[i]
        handles.append(hook((i, "mlp"), layer.mlp.down_proj, lambda m=layer.mlp: m.down_proj.in_features))
        handles.append(hook((i, "attn"), layer.self_attn.o_proj, lambda a=layer.self_attn: a.num_heads))
        if kind is Importance.TAYLOR:  # the hooked activations must require grad
            flags.update({p: p.requires_grad for p in layer.parameters()})
            layer.requires_grad_(True)
    try:
        for ids in batches:
            if kind is Importance.TAYLOR:
                with torch.enable_grad():
                    _exit_ce(model, ids).backward()
            else:
                with torch.no_grad():
                    model(ids)
    finally:
        for h in handles:
            h.remove()
        for p, flag in flags.items():
            p.requires_grad_(flag)
        if kind is Importance.TAYLOR:
            model.zero_grad(set_to_none=True)
    n = sum(ids.shape[0] * ids.shape[1] for ids in batches)  # every token passes every layer
    return {i: LayerImportance(sums[(i, "mlp")] / n, sums[(i, "attn")] / n) for i in layers}


# ---- the progressive loop -----------------------------------------------------------------------
def _check_fits(cfg: PruneConfig, model: MultiExitModel, layers: list[int], length: int) -> None:
    if not layers:
        raise ConfigError(f"prune: the model has no decision exit before its last layer (exits {model.exit_layers})")
    if length < cfg.seq_len:
        raise ConfigError(f"prune.seq_len is {cfg.seq_len} but the calibration windows hold {length} tokens")
    for i in layers:
        attn, mlp = model.backbone.layers[i].self_attn, model.backbone.layers[i].mlp
        rep = attn.num_heads // attn.num_kv_heads
        if cfg.heads_per_group >= rep:
            raise ConfigError(f"prune.heads_per_group = {cfg.heads_per_group} would leave no query head in a KV "
                              f"group of layer {i} ({rep} query heads per KV head)")
        if round(cfg.mlp_fraction * mlp.down_proj.in_features) >= mlp.down_proj.in_features:
            raise ConfigError(f"prune.mlp_fraction = {cfg.mlp_fraction} would remove every neuron of layer {i}")


def _exits_from(model: MultiExitModel, h: torch.Tensor, start: int, stop: int | None = None) -> dict:
    """Run decoder layers ``start`` .. from h [B, T, D] (the hidden state after ``start`` layers; ids
    [B, T] when start = 0). Returns {exit: logits [B, T, V]} of the exits reached, and under key
    "h" the hidden state after ``stop`` layers. Mirrors Decoder.forward without a past."""
    dec = model.backbone
    out: dict[Any, torch.Tensor] = {}
    if start == 0:
        h = dec.embed(h)
    b, t = h.shape[:2]
    pos = torch.arange(t, device=h.device).unsqueeze(0).expand(b, t)  # [B, T]
    cos, sin = dec.rope(pos)
    fused = dec.training and dec.cfg.sliding_window is None
    mask = None if fused else attention_mask(pos, pos, window=dec.cfg.sliding_window)
    for i in range(start, dec.cfg.num_layers):
        if i == stop:
            out["h"] = h
        h, _, _ = dec.layers[i](h, cos, sin, None, None, mask)
        if i + 1 in model.exit_layers:
            out[i + 1] = model.exit_logits(i + 1, h)
    return out


def _same_prefix(model: MultiExitModel, teacher: MultiExitModel, first: int) -> bool:
    """Whether embeddings and layers before ``first`` are equal, so the student can start from the
    teacher's hidden state after ``first`` layers (they are frozen, so they stay equal)."""
    sd_s, sd_t = model.backbone.state_dict(), teacher.backbone.state_dict()
    names = [n for n in sd_s if n.startswith("embed") or (n.startswith("layers.") and int(n.split(".")[1]) < first)]
    return all(n in sd_t and sd_s[n].shape == sd_t[n].shape and torch.equal(sd_s[n], sd_t[n]) for n in names)


def _kl(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    """T^2 KL(p_teacher^T || p_student^T), mean over rows (Hinton et al. 2015); logits [N, V]."""
    log_q, log_p = F.log_softmax(student.float() / t, -1), F.log_softmax(teacher.float() / t, -1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * t * t


def _recover(model: MultiExitModel, teacher: MultiExitModel, layers: list[int],
             draw: Callable[[], torch.Tensor], cfg: PruneConfig) -> list[float]:
    """``cfg.recovery_steps`` of AdamW on the pruned ``layers``: mean over exits of the KL from the
    teacher's exit to the same exit of the student, over every token."""
    params = [p for i in layers for p in model.backbone.layers[i].parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    first = layers[0]
    shared = first > 0 and _same_prefix(model, teacher, first)
    losses = []
    for _ in range(cfg.recovery_steps):
        ids = draw()  # [B, T]
        with torch.no_grad():
            t_out = _exits_from(teacher, ids, 0, stop=first)
        s_logits = _exits_from(model, t_out["h"], first) if shared else _exits_from(model, ids, 0)
        v = t_out[model.exit_layers[-1]].shape[-1]
        loss = sum(_kl(s.reshape(-1, v), t_out[k].reshape(-1, v), cfg.temperature) for k, s in s_logits.items())
        loss = loss / len(s_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def prune_near_exits(model: MultiExitModel, teacher: MultiExitModel, windows_ids: Any,
                     cfg: PruneConfig) -> PruneResult:
    """Prune ``model`` in place near its decision exits (module docstring), distilling from ``teacher``
    (unpruned, left unchanged) on token windows ``windows_ids`` [N, L >= cfg.seq_len] (tensor or array).
    Modes and requires_grad flags of both models are restored. Returns sizes and parameter counts
    before / after, recovery losses, and the shapes to store with the weights.

    Raises:
        ConfigError: no decision exit, windows shorter than seq_len, or a removal that empties a layer.
    """
    start = time.perf_counter()
    dec = model.backbone
    layers = pruned_layers(model.exit_layers, cfg.layers_before_exit)
    device = dec.embed_tokens.weight.device
    ids_all = torch.as_tensor(windows_ids, dtype=torch.long, device=device)
    if ids_all.ndim != 2 or ids_all.shape[0] == 0:
        raise ConfigError(f"prune: calibration windows must be [N, L] with N >= 1, got shape {tuple(ids_all.shape)}")
    _check_fits(cfg, model, layers, ids_all.shape[1])
    ids_all = ids_all[:, :cfg.seq_len]
    gen = torch.Generator().manual_seed(cfg.seed)

    def draw() -> torch.Tensor:
        return ids_all[torch.randint(0, ids_all.shape[0], (cfg.batch_size,), generator=gen).to(device)]

    before = {i: (dec.layers[i].mlp.down_proj.in_features, dec.layers[i].self_attn.num_heads,
                  num_params(dec.layers[i])) for i in layers}
    params_before = num_params(model)
    neuron_plan = {i: schedule(round(cfg.mlp_fraction * before[i][0]), cfg.steps) for i in layers}
    head_plan = schedule(cfg.heads_per_group, cfg.steps)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = (model.training, teacher.training)
    step_losses: list[list[float]] = []
    try:
        model.train()  # no dropout in the decoder; train mode selects the fused causal attention
        teacher.train()
        for p in model.parameters():
            p.requires_grad_(False)
        for step in range(cfg.steps):
            scores = measure_importance(model, layers, [draw() for _ in range(cfg.calib_batches)], cfg.importance)
            for i in layers:
                layer = dec.layers[i]
                n_keep = layer.mlp.down_proj.in_features - neuron_plan[i][step]
                if n_keep < layer.mlp.down_proj.in_features:
                    prune_mlp(layer.mlp, keep_top(scores[i].neurons, n_keep))
                if head_plan[step]:
                    prune_heads(layer.self_attn, keep_heads_per_group(
                        scores[i].heads, layer.self_attn.num_kv_heads, head_plan[step]))
                layer.requires_grad_(True)  # new modules: make sure every parameter of the layer trains
            step_losses.append(_recover(model, teacher, layers, draw, cfg))
    finally:
        model.zero_grad(set_to_none=True)  # the recovery's gradients are of no use to the caller
        model.train(modes[0])
        teacher.train(modes[1])
        for n, p in model.named_parameters():
            p.requires_grad_(flags.get(n, True))
    rows = [LayerPrune(i, before[i][0], dec.layers[i].mlp.down_proj.in_features, before[i][1],
                       dec.layers[i].self_attn.num_heads, before[i][2], num_params(dec.layers[i])) for i in layers]
    return PruneResult(cfg.importance.value, rows, params_before, num_params(model), step_losses,
                       layer_shapes(model), time.perf_counter() - start)
