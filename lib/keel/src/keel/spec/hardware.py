"""`Hardware`: what one accelerator, its host and its links offer, as declared facts for the planner.

The planner's step-time model (`keel.plan.step_time`) prices each kind of traffic on the link it
crosses: the expert all-to-all and FSDP collectives on the in-domain link while they stay inside
the fast (NVLink) domain and on the scale-out link once they leave it, the cross-rack gradient
all-reduce on the scale-out link, host-offload copies on the host link. Bandwidths are per GPU and
per direction, in GB/s (1e9 bytes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from keel.spec.transports import ACCELERATOR_ONLY

PLATFORMS = ("gpu", "tpu", "cpu")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclass(frozen=True)
class StepTimeCalibration:
    """The constants the step-time model cannot know from data sheets, fitted on observed steps.

    `compute_efficiency`: the fraction of the peak FLOP rate the step's matmuls achieve;
    `collective_sync_s`: the cost of each expert collective beyond its bytes (the barrier across
    the expert group: every GPU waits for the most loaded one). `fitted_on` names the run and
    observations they were fitted on (`keel.plan.step_time.calibrate` refits them).
    """

    compute_efficiency: float
    collective_sync_s: float
    fitted_on: str

    def __post_init__(self):
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"StepTimeCalibration.compute_efficiency={self.compute_efficiency} must lie in (0, 1]")
        if self.collective_sync_s < 0:
            raise ValueError(f"StepTimeCalibration.collective_sync_s={self.collective_sync_s} must be >= 0")


@dataclass(frozen=True)
class Hardware:
    """An accelerator kind and how a run uses its racks.

    `gpus_per_rack` is how many devices of a rack a run uses (a GB200 NVL72 rack has 72 GPUs; the
    hero uses 64 of them, 16 hosts x 4). `peak_flops_per_device` is the dense bf16 peak used for
    MFU (None: no meaningful peak, e.g. simulated CPU devices). `platform` is the JAX platform;
    on "cpu" the devices are simulated, as many as the step's topology asks for, in the step's own
    process (`process_env`).

    Links and host (None: unknown, so the step-time model or the host check says what is missing):
    `hbm_gb_per_s`; `fast_domain_gpus`, the GPUs one NVLink domain joins (72 in a GB200 NVL72 rack,
    8 in an HGX host), and `link_gb_per_s` between them; `scale_out_gb_per_s`, each GPU's share of
    the network between domains (InfiniBand / RoCE); `gpus_per_host`, `host_ram_per_host_gb` and
    `host_link_gb_per_s` (each GPU's link to host memory: NVLink-C2C or PCIe). `calibration`: the
    fitted step-time constants the planner uses for runs nobody has measured on this hardware.
    """

    name: str
    gpus_per_rack: int
    hbm_per_device_gb: float
    physical_gpus_per_rack: int | None = None
    peak_flops_per_device: float | None = None
    supports_ragged_all_to_all: bool = False
    platform: str = "gpu"
    hbm_gb_per_s: float | None = None
    fast_domain_gpus: int | None = None
    link_gb_per_s: float | None = None
    scale_out_gb_per_s: float | None = None
    gpus_per_host: int | None = None
    host_ram_per_host_gb: float | None = None
    host_link_gb_per_s: float | None = None
    calibration: StepTimeCalibration | None = None

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"Hardware.platform={self.platform!r} is unknown: use one of {', '.join(PLATFORMS)}")
        if self.gpus_per_rack <= 0:
            raise ValueError(f"Hardware.gpus_per_rack={self.gpus_per_rack} must be positive")
        if self.physical_gpus_per_rack is not None and self.gpus_per_rack > self.physical_gpus_per_rack:
            raise ValueError(
                f"Hardware.gpus_per_rack={self.gpus_per_rack} exceeds physical_gpus_per_rack="
                f"{self.physical_gpus_per_rack}: a run cannot use more GPUs than a rack has"
            )
        if self.hbm_per_device_gb <= 0:
            raise ValueError(f"Hardware.hbm_per_device_gb={self.hbm_per_device_gb} must be positive")
        for name in ("peak_flops_per_device", "physical_gpus_per_rack", "hbm_gb_per_s", "fast_domain_gpus",
                     "link_gb_per_s", "scale_out_gb_per_s", "gpus_per_host", "host_ram_per_host_gb", "host_link_gb_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Hardware.{name}={value!r} must be positive (or None: unknown)")

    @property
    def hbm_per_rack_gb(self) -> float:
        return self.hbm_per_device_gb * self.gpus_per_rack

    def process_env(self, num_devices: int) -> dict[str, str]:
        """Environment variables a step's process needs to see `num_devices` devices of this kind.

        Simulated CPU racks need XLA to split the host into that many devices (before jax is
        imported, hence a fresh process). Real accelerators are found by jax as they are, so their
        step only drops what a launcher's shell may hold from a CPU run (`JAX_PLATFORMS=cpu`, the
        simulated device count), which would otherwise train it on fake CPU devices; an empty
        `JAX_PLATFORMS` is jax's own default, every platform present. Nothing else is set, so a
        cluster worker's own flags stand.
        """
        flags = os.environ.get("XLA_FLAGS", "").split()
        kept = [f for f in flags if not f.startswith(_DEVICE_COUNT_FLAG)]
        if self.platform == "cpu":
            return {"XLA_FLAGS": " ".join([*kept, f"{_DEVICE_COUNT_FLAG}={num_devices}"]), "JAX_PLATFORMS": "cpu"}
        env = {"XLA_FLAGS": " ".join(kept)} if len(kept) < len(flags) else {}
        if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
            env["JAX_PLATFORMS"] = ""
        return env

    def supports_transport(self, transport: str) -> bool:
        """Whether the backend can run an expert transport (XLA:CPU lacks ragged-all-to-all)."""
        return transport not in ACCELERATOR_ONLY or self.supports_ragged_all_to_all
