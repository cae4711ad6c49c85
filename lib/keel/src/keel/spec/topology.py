"""`RackTopology`: how a run lays its devices out in racks, and the mesh axis sizes that follow.

Axes: `replica_dcn` (one per rack, across racks), and inside a rack's fast domain `data`,
`expert` and `model`. Routed experts are split over `expert`; the batch over
(`replica_dcn`, `data`, `expert`); other parameters and optimizer state are FSDP-sharded over
(`data`, `expert`) inside a rack and replicated across racks. Plain config: the JAX mesh is built
from it where the training step runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.spec.model import MoELMConfig

MESH_AXES = ("replica_dcn", "data", "expert", "model")
BATCH_AXES = ("replica_dcn", "data", "expert")


class TopologyError(ValueError):
    """A rack layout that cannot run the declared model and batch."""


@dataclass(frozen=True)
class RackTopology:
    """`racks` x `gpus_per_rack` devices; inside a rack, expert x model x data (data is the rest)."""

    racks: int
    gpus_per_rack: int
    expert_parallel: int = 1
    model_parallel: int = 1
    hbm_per_gpu_gb: float | None = None
    """HBM per device; None takes it from the declared `Hardware`."""

    def __post_init__(self):
        for name in ("racks", "gpus_per_rack", "expert_parallel", "model_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TopologyError(f"RackTopology.{name}={value!r} must be a positive integer")
        if self.model_parallel > 1:
            raise TopologyError(f"RackTopology.model_parallel={self.model_parallel}: no parameter is split over the "
                                "`model` axis yet (keel.spec.placement), so its devices would hold the same weights and "
                                "the same batch rows and repeat each other's work; use data or expert parallelism")
        if self.hbm_per_gpu_gb is not None and not self.hbm_per_gpu_gb > 0:
            raise TopologyError(f"RackTopology.hbm_per_gpu_gb={self.hbm_per_gpu_gb!r} must be positive (or None: the "
                                "declared Hardware's)")
        if self.expert_parallel * self.model_parallel > self.gpus_per_rack:
            raise TopologyError(
                f"RackTopology.expert_parallel={self.expert_parallel} (x model_parallel={self.model_parallel}) is larger "
                f"than a rack (gpus_per_rack={self.gpus_per_rack}): expert parallelism stays inside one rack's "
                "NVLink domain; lower expert_parallel"
            )
        if self.gpus_per_rack % (self.expert_parallel * self.model_parallel):
            raise TopologyError(
                f"RackTopology.expert_parallel={self.expert_parallel} x model_parallel={self.model_parallel} must divide "
                f"gpus_per_rack={self.gpus_per_rack}: pick a divisor of gpus_per_rack"
            )

    @property
    def num_devices(self) -> int:
        return self.racks * self.gpus_per_rack

    @property
    def replica_dcn(self) -> int:
        return self.racks

    @property
    def expert(self) -> int:
        return self.expert_parallel

    @property
    def model(self) -> int:
        return self.model_parallel

    @property
    def data(self) -> int:
        return self.gpus_per_rack // (self.expert_parallel * self.model_parallel)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"replica_dcn": self.replica_dcn, "data": self.data, "expert": self.expert, "model": self.model}

    @property
    def batch_shards(self) -> int:
        """Devices the global batch is split over: replica_dcn x data x expert."""
        return self.replica_dcn * self.data * self.expert

    def experts_per_device(self, model: MoELMConfig) -> int:
        return model.num_experts // self.expert_parallel

    def check_device_count(self, num_devices: int) -> None:
        """Raise `TopologyError` naming the fix unless `num_devices` devices make this topology."""
        if num_devices != self.num_devices:
            raise TopologyError(
                f"RackTopology: {num_devices} devices are present but racks={self.racks} x gpus_per_rack="
                f"{self.gpus_per_rack} = {self.num_devices}: set racks and gpus_per_rack to match the devices"
            )

    def validate(self, model: MoELMConfig, global_batch: int, num_devices: int | None = None) -> None:
        """Raise `TopologyError` naming the field and the fix if the layout cannot run this model and batch."""
        if num_devices is not None:
            self.check_device_count(num_devices)
        if model.num_experts and model.num_experts % self.expert_parallel:
            raise TopologyError(
                f"RackTopology.expert_parallel={self.expert_parallel} does not divide MoELMConfig.num_experts="
                f"{model.num_experts}: choose an expert_parallel that divides the expert count"
            )
        if not model.num_experts and self.expert_parallel > 1:
            raise TopologyError(
                f"RackTopology.expert_parallel={self.expert_parallel} with a dense model (num_experts=0): set it to 1"
            )
        if global_batch % self.batch_shards:
            raise TopologyError(
                f"TrainConfig.batch_size={global_batch} is not divisible by the {self.batch_shards} batch shards "
                f"(replica_dcn {self.replica_dcn} x data {self.data} x expert {self.expert}): use a multiple of "
                f"{self.batch_shards} (e.g. {max(1, round(global_batch / self.batch_shards)) * self.batch_shards}) "
                "or change racks"
            )
