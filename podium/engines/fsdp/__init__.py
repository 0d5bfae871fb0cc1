"""A training engine on FSDP2 (``fully_shard``) over a ``DeviceMesh``, backend-neutral.

``FSDPEngine`` holds one rank's share of the model; ``TrainingWorker`` drives it from the
controller with nd-mesh dispatch. Runs unchanged on every backend with a process group
(ray, torchrun) and under plain ``torchrun``; gives bit-identical results across them
because threads, seeds and the batch split are settings of the engine
(:class:`EngineConfig`), and sampling randomness belongs to each sample.
"""

from podium.engines.fsdp.config import EngineConfig
from podium.engines.fsdp.engine import FSDPEngine, init_distributed
from podium.engines.fsdp.hf import HFCausalLM
from podium.engines.fsdp.model import LMConfig, TinyLM
from podium.engines.fsdp.sampling import per_sample_uniforms, sample_tokens
from podium.engines.fsdp.worker import MESH_NAME, TrainingWorker

__all__ = [
    "MESH_NAME",
    "EngineConfig",
    "FSDPEngine",
    "HFCausalLM",
    "LMConfig",
    "TinyLM",
    "TrainingWorker",
    "init_distributed",
    "per_sample_uniforms",
    "sample_tokens",
]
