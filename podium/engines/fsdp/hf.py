"""Hugging Face causal LMs as engine models (``pip install 'podium[hf]'``).

:class:`HFCausalLM` is a model factory for :class:`~podium.engines.fsdp.EngineConfig`:
it builds any ``transformers`` causal LM from a config -- a model type and its fields,
nothing downloaded -- with random weights from the engine's seed. FSDP2 shards each
decoder layer (``model.layers``), then the root. Tensor parallelism is not offered for
these models (use ``tp=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["HFCausalLM"]


@dataclass(frozen=True)
class HFCausalLM:
    """``HFCausalLM("llama", vocab_size=16, hidden_size=32, ...)``: a picklable factory.

    Calling it returns ``AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type,
    **fields))``. The fields are checked by ``transformers`` when the model is built.
    """

    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)

    def __init__(self, model_type: str, **fields: Any) -> None:
        if not isinstance(model_type, str) or not model_type:
            raise ValueError(f"HFCausalLM needs a model type such as 'llama', got {model_type!r}")
        object.__setattr__(self, "model_type", model_type)
        object.__setattr__(self, "fields", dict(fields))

    def __call__(self) -> nn.Module:
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as exc:
            raise ImportError("HFCausalLM needs transformers: pip install 'podium[hf]'") from exc
        # The engine never reuses a key/value cache between calls: do not build one.
        config = AutoConfig.for_model(self.model_type, **{"use_cache": False, **self.fields})
        model: nn.Module = AutoModelForCausalLM.from_config(config)
        return model
