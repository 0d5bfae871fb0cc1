"""``TrainingWorker``: an :class:`FSDPEngine` driven from the controller with nd-mesh dispatch.

``init_model`` (sent to every rank) joins the process group, builds the mesh and the
engine, and registers the rank's place in the mesh ``"train"``: its DP rank, and
``is_collect`` on TP rank 0. The data methods then split a batch into one shard per DP
replica, send that shard (serialized once) to every TP rank of the replica, and collect
one output per replica. Because the process group is made in a method, not in
``__init__``, the worker also works as one role of a colocated worker (the first role
to initialize creates the group, the others reuse it).

The batch contract (``DataProto`` tensors, one row per sequence):

- ``generate``: ``prompts [B, P]`` and ``sample_index [B]`` (the row's index in the
  global batch); ``meta_info``: ``step``, ``max_new_tokens``, optional ``temperature``
  (1.0) and ``seed`` (the engine's). Returns ``responses [B, R]`` and ``input_ids``.
- ``compute_log_prob``: ``input_ids`` and ``responses``; returns ``log_probs [B, R]``.
- ``train_batch``: see :meth:`FSDPEngine.train_step`; returns the metrics dict, one per
  DP replica (identical: they describe the global batch).
"""

from __future__ import annotations

from typing import Any

import torch

from podium.core.decorator import Dispatch, register
from podium.core.dispatch import make_nd_compute_dataproto_dispatch_fn
from podium.core.protocol import DataProto
from podium.core.worker import Worker
from podium.engines.fsdp.config import EngineConfig
from podium.engines.fsdp.engine import FSDPEngine

__all__ = ["MESH_NAME", "TrainingWorker"]

MESH_NAME = "train"
_ND = make_nd_compute_dataproto_dispatch_fn(MESH_NAME)


class TrainingWorker(Worker):
    """One rank of a model trained (or, with ``trainable=False``, only evaluated) with FSDP2."""

    def __init__(self, config: EngineConfig) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"TrainingWorker needs an EngineConfig, got {type(config).__name__}")
        self.config = config
        self._engine: FSDPEngine | None = None

    @property
    def engine(self) -> FSDPEngine:
        if self._engine is None:
            raise RuntimeError("call init_model() on the worker group before using the model")
        return self._engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, int]:
        """Join the process group, build and shard the model; return this rank's place in the mesh."""
        if self._engine is not None:
            raise RuntimeError("init_model() was already called on this worker")
        self._engine = engine = FSDPEngine(self.config)
        self._register_dispatch_collect_info(
            MESH_NAME, dp_rank=engine.dp_rank, is_collect=engine.tp_rank == 0
        )
        return {
            "rank": self.rank,
            "dp_rank": engine.dp_rank,
            "tp_rank": engine.tp_rank,
            "dp_size": engine.dp_size,
        }

    @register(dispatch_mode=_ND)
    def generate(self, data: DataProto) -> DataProto:
        batch = _tensors(data, "generate", ("prompts", "sample_index"))
        meta = data.meta_info
        for key in ("step", "max_new_tokens"):
            if key not in meta:
                raise KeyError(f"generate needs meta_info[{key!r}]")
        responses = self.engine.generate(
            batch["prompts"],
            batch["sample_index"],
            max_new_tokens=int(meta["max_new_tokens"]),
            step=int(meta["step"]),
            temperature=float(meta.get("temperature", 1.0)),
            seed=meta.get("seed"),
        )
        input_ids = torch.cat([batch["prompts"], responses.to(batch["prompts"].dtype)], dim=1)
        return DataProto.from_dict({"responses": responses, "input_ids": input_ids})

    @register(dispatch_mode=_ND)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        batch = _tensors(data, "compute_log_prob", ("input_ids", "responses"))
        log_probs = self.engine.compute_log_prob(
            batch["input_ids"],
            batch["responses"].shape[1],
            float(data.meta_info.get("temperature", 1.0)),
        )
        return DataProto.from_dict({"log_probs": log_probs})

    @register(dispatch_mode=_ND)
    def train_batch(self, data: DataProto) -> dict[str, float]:
        batch = _tensors(data, "train_batch", ("input_ids", "responses", "advantages"))
        return self.engine.train_step(
            batch, temperature=float(data.meta_info.get("temperature", 1.0))
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        return self.engine.load_checkpoint(path)

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.close()


def _tensors(data: Any, method: str, required: tuple[str, ...]) -> dict[str, torch.Tensor]:
    if not isinstance(data, DataProto) or data.batch is None:
        raise TypeError(f"{method} needs a DataProto with tensors, got {type(data).__name__}")
    keys = set(data.batch.keys())
    missing = [k for k in required if k not in keys]
    if missing:
        raise KeyError(f"{method} needs the tensors {missing} in the batch; it has {sorted(keys)}")
    return {str(k): data.batch[k] for k in keys}
