"""Model shapes the planner reasons about: Llama 3 presets or a JSON file with the same fields.

Only what sizes memory, compute and communication is kept: a dense decoder with grouped-query
attention, a SwiGLU MLP, RMSNorm, untied input embedding and output layer (as in Llama 3).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

from l3plugin.arguments.checks import check_int

LLAMA3_VOCAB = 128256


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int  # GQA: key/value heads shared by num_attention_heads / num_kv_heads query heads
    vocab_size: int = LLAMA3_VOCAB

    def __post_init__(self):
        for f in fields(self):
            if f.name == "name":
                continue
            check_int(f"model field {f.name}", getattr(self, f.name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}: the head dimension must be an integer")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}: GQA needs whole query groups")

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv heads x head dim; smaller than hidden with GQA."""
        return self.num_kv_heads * self.head_dim

    # ---- parameters ---------------------------------------------------------------------------
    @property
    def layer_matmul_params(self) -> int:
        """Q and O (h x h), K and V (h x kv_dim), gate, up and down (h x ffn)."""
        h = self.hidden_size
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn_hidden_size

    @property
    def layer_params(self) -> int:
        return self.layer_matmul_params + 2 * self.hidden_size  # + the two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.hidden_size  # output layer + final norm

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.output_params

    # ---- forward FLOPs for one sequence of `seq_len` tokens (backward costs twice as much) --------
    def layer_forward_flops(self, seq_len: int) -> float:
        """2 FLOPs per weight per token, plus causal attention: QK^T and PV cost 2*s*s*h each,
        halved by the causal mask."""
        return 2.0 * seq_len * self.layer_matmul_params + 2.0 * seq_len * seq_len * self.hidden_size

    def output_forward_flops(self, seq_len: int) -> float:
        return 2.0 * seq_len * self.hidden_size * self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # Public Llama 3 / 3.1 shapes. 405B has 126 layers: the paper removed one layer from each end of
    # 128 so that the first and last pipeline stages, which also hold the embedding and the output
    # layer, carry one layer fewer (section 3.1.2).
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 14336, 32, 8),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 28672, 64, 8),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 53248, 128, 8),
}

MODEL_FIELDS = tuple(f.name for f in fields(ModelSpec))
REQUIRED_FIELDS = tuple(n for n in MODEL_FIELDS if n not in ("name", "vocab_size"))


def model_from_dict(data: dict, source: str = "model") -> ModelSpec:
    if not isinstance(data, dict):
        raise ValueError(f"{source} must be a JSON object with fields {list(MODEL_FIELDS)}")
    unknown = sorted(set(data) - set(MODEL_FIELDS))
    missing = [n for n in REQUIRED_FIELDS if n not in data]
    if unknown or missing:
        parts = []
        if missing:
            parts.append(f"missing field(s) {missing}")
        if unknown:
            parts.append(f"unknown field(s) {unknown}")
        raise ValueError(f"{source}: {' and '.join(parts)}; required fields are {list(REQUIRED_FIELDS)}, "
                         f"optional are ['name', 'vocab_size'] (vocab_size defaults to {LLAMA3_VOCAB})")
    values = dict(data)
    values.setdefault("name", os.path.splitext(os.path.basename(source))[0] if source != "model" else "custom")
    values.setdefault("vocab_size", LLAMA3_VOCAB)
    if not isinstance(values["name"], str):
        raise ValueError(f"{source}: name={values['name']!r} must be a string")
    try:
        return ModelSpec(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_model(model: "str | ModelSpec") -> ModelSpec:
    """A preset name, a path to a JSON file with the ModelSpec fields, or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if model in PRESETS:
        return PRESETS[model]
    if model.endswith(".json") or os.path.isfile(model):
        try:
            with open(model) as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise ValueError(f"--model {model!r}: no such file; use a preset ({', '.join(PRESETS)}) "
                             f"or a JSON file with fields {list(MODEL_FIELDS)}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--model {model!r} is not valid JSON: {exc}") from None
        return model_from_dict(data, source=model)
    raise ValueError(f"--model {model!r} is not a known preset: valid presets are {', '.join(PRESETS)}, "
                     f"or pass a path to a JSON file with fields {list(MODEL_FIELDS)}")
