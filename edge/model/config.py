"""Typed model configuration, read from a Hugging Face ``config.json``.

One :class:`ModelConfig` describes every supported family (Llama, Qwen2,
Mistral); the family only changes a few switches (attention biases, sliding
window, tied embeddings, RoPE scaling).
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from edge.core.errors import CheckpointError


class Arch(str, enum.Enum):
    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    MISTRAL = "MistralForCausalLM"


SUPPORTED_ARCHS = tuple(a.value for a in Arch)
_MODEL_TYPE = {Arch.LLAMA: "llama", Arch.QWEN2: "qwen2", Arch.MISTRAL: "mistral"}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters`` / ``rope_scaling``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    """Shape and switches of a Llama-family decoder."""

    arch: Arch = Arch.LLAMA
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 12
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    intermediate_size: int = 768
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False  # Llama ``attention_bias`` sets both
    mlp_bias: bool = False
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        self.arch = Arch(self.arch)
        if isinstance(self.rope, dict):
            self.rope = RopeConfig(**self.rope)
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope.rope_type not in _ROPE_TYPES:
            raise CheckpointError(f"unsupported rope_type {self.rope.rope_type!r}; supported: {', '.join(_ROPE_TYPES)}")

    @property
    def n_rep(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * self.num_heads * hd * 2 + d * self.kv_dim * 2
        attn += (self.num_heads * hd + 2 * self.kv_dim) * self.qkv_bias + d * self.o_bias
        mlp = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    # ---- Hugging Face config.json -------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a parsed HF ``config.json``.

        Raises:
            CheckpointError: unsupported architecture or a missing / malformed field.
        """
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        arch = Arch(arch)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = _rope_from_hf(cfg)
            attn_bias = bool(cfg.get("attention_bias", False))
            window = cfg.get("sliding_window")
            if arch is Arch.QWEN2 and not cfg.get("use_sliding_window", False):
                window = None
            eos = cfg.get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            return cls(
                arch=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=True if arch is Arch.QWEN2 else attn_bias,
                o_bias=attn_bias and arch is not Arch.QWEN2,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                rope=rope,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=eos,
            )
        except KeyError as exc:
            raise CheckpointError(f"{source}: missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: malformed field: {exc}") from exc

    def to_hf(self) -> dict[str, Any]:
        """The equivalent HF ``config.json`` (transformers v4 and v5 both read it)."""
        rope_params = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type != "default":
            rope_params["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope_params.update(
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        out = {
            "architectures": [self.arch.value],
            "model_type": _MODEL_TYPE[self.arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope.theta,
            "rope_parameters": rope_params,
            "rope_scaling": None if self.rope.rope_type == "default" else rope_params,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float16",
        }
        if self.arch is Arch.LLAMA:
            out.update(attention_bias=self.o_bias, mlp_bias=self.mlp_bias)
        if self.arch is Arch.MISTRAL:
            out["sliding_window"] = self.sliding_window
        if self.arch is Arch.QWEN2:
            out.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arch"] = self.arch.value
        return d


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either transformers v5 ``rope_parameters`` or v4 ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    out = RopeConfig(theta=theta, rope_type=rope_type)
    if rope_type != "default":
        out.factor = float(merged["factor"])
    if rope_type == "llama3":
        out.low_freq_factor = float(merged["low_freq_factor"])
        out.high_freq_factor = float(merged["high_freq_factor"])
        out.original_max_position_embeddings = int(merged["original_max_position_embeddings"])
    if not math.isfinite(out.theta) or out.theta <= 0:
        raise CheckpointError(f"rope_theta must be a positive number, got {out.theta}")
    return out


# Named presets (gpt-fast style ``ModelArgs.from_name``).
PRESETS: dict[str, ModelConfig] = {
    # The bundled tiny model: 12 layers, ~10.5M parameters, 4096-token byte-level BPE.
    "tiny": ModelConfig(),
    # Used by fast unit tests.
    "micro": ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, max_position_embeddings=128),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise CheckpointError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    import copy

    return copy.deepcopy(PRESETS[name])
