"""`Hardware`: what one accelerator and one rack of them offer, as declared facts for the planner."""

from __future__ import annotations

from dataclasses import dataclass

from keel.model.transport_spec import ACCELERATOR_ONLY


@dataclass(frozen=True)
class Hardware:
    """An accelerator kind and how a run uses its racks.

    `gpus_per_rack` is how many devices of a rack a run uses (a GB200 NVL72 rack has 72 GPUs; the
    hero uses 64 of them, 16 hosts x 4). `peak_flops_per_device` is the dense bf16 peak used for
    MFU (None: no meaningful peak, e.g. simulated CPU devices).
    """

    name: str
    gpus_per_rack: int
    hbm_per_device_gb: float
    physical_gpus_per_rack: int | None = None
    peak_flops_per_device: float | None = None
    supports_ragged_all_to_all: bool = False
    host_memory_per_device_gb: float | None = None

    def __post_init__(self):
        if self.gpus_per_rack <= 0:
            raise ValueError(f"Hardware.gpus_per_rack={self.gpus_per_rack} must be positive")
        if self.physical_gpus_per_rack is not None and self.gpus_per_rack > self.physical_gpus_per_rack:
            raise ValueError(
                f"Hardware.gpus_per_rack={self.gpus_per_rack} exceeds physical_gpus_per_rack="
                f"{self.physical_gpus_per_rack}: a run cannot use more GPUs than a rack has"
            )
        if self.hbm_per_device_gb <= 0:
            raise ValueError(f"Hardware.hbm_per_device_gb={self.hbm_per_device_gb} must be positive")

    @property
    def hbm_per_rack_gb(self) -> float:
        return self.hbm_per_device_gb * self.gpus_per_rack

    def supports_transport(self, transport: str) -> bool:
        """Whether the backend can run an expert transport (XLA:CPU lacks ragged-all-to-all)."""
        return transport not in ACCELERATOR_ONLY or self.supports_ragged_all_to_all
