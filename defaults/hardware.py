"""Hardware presets: declared facts about the accelerators a run is planned for."""

from keel.mesh import Hardware

gb200_nvl72 = Hardware(
    name="GB200 NVL72",
    gpus_per_rack=64,  # of the rack's 72 GPUs a run uses 64: 16 hosts x 4
    physical_gpus_per_rack=72,
    hbm_per_device_gb=192.0,
    peak_flops_per_device=2.5e15,  # dense bf16
    supports_ragged_all_to_all=True,
)

cpu_sim = Hardware(
    name="simulated CPU racks",
    gpus_per_rack=4,  # 8 simulated host devices as 2 racks x 4
    hbm_per_device_gb=2.0,  # a share of this machine's RAM; only for the planner's arithmetic
    peak_flops_per_device=None,
    supports_ragged_all_to_all=False,  # XLA:CPU has no ragged-all-to-all
    platform="cpu",
)
"""Racks of simulated CPU devices (4 a rack): a step declaring it runs in its own process with
`--xla_force_host_platform_device_count` set to its topology's device count (2 racks x 4 = 8)."""
