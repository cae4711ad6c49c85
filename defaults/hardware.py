"""Hardware presets: declared facts about the accelerators a run is planned for.

Data-sheet figures: dense bf16 peak, HBM size and bandwidth, the NVLink domain and its per-GPU
bandwidth (each direction), the scale-out network per GPU (one 400 Gb/s NIC = 50 GB/s), host RAM
per host and each GPU's link to it (NVLink-C2C on Grace, PCIe Gen5 x16 elsewhere). A "rack" is
the unit a run replicates over (`replica_dcn`): a GB200 NVL72 rack, or one 8-GPU HGX host.

`hero_calibration` holds the step-time model's two fitted constants
(`keel.plan.step_time.calibrate` on the hero's observed 19.8 s pooled and 16.8 s ragged steps;
tests/test_plan_step_time.py refits them): every preset uses it until a run on that hardware is
measured.
"""

import dataclasses

from keel.spec import Hardware, StepTimeCalibration

hero_calibration = StepTimeCalibration(
    compute_efficiency=0.3602,
    collective_sync_s=0.004364,
    fitted_on="hero-12d8b6f0-dee637: 19.8 s at step 0, 16.8 s at step 81,716",
)

gb200_nvl72 = Hardware(
    name="GB200 NVL72",
    gpus_per_rack=64,  # of the rack's 72 GPUs a run uses 64: 16 hosts x 4
    physical_gpus_per_rack=72,
    hbm_per_device_gb=192.0,
    peak_flops_per_device=2.5e15,  # dense bf16
    supports_ragged_all_to_all=True,
    hbm_gb_per_s=8000.0,
    fast_domain_gpus=72,  # the whole rack is one NVLink domain
    link_gb_per_s=900.0,  # NVLink 5: 1.8 TB/s per GPU both ways
    scale_out_gb_per_s=50.0,
    gpus_per_host=4,
    host_ram_per_host_gb=960.0,  # 2 Grace x 480 GB LPDDR5X
    host_link_gb_per_s=450.0,  # NVLink-C2C: 900 GB/s both ways
    calibration=hero_calibration,
)

h100_sxm = Hardware(
    name="H100 SXM (HGX, InfiniBand)",
    gpus_per_rack=8,
    physical_gpus_per_rack=8,
    hbm_per_device_gb=80.0,
    peak_flops_per_device=989e12,
    supports_ragged_all_to_all=True,
    hbm_gb_per_s=3350.0,
    fast_domain_gpus=8,
    link_gb_per_s=450.0,  # NVLink 4: 900 GB/s per GPU both ways
    scale_out_gb_per_s=50.0,  # NDR 400 Gb/s per GPU
    gpus_per_host=8,
    host_ram_per_host_gb=2048.0,
    host_link_gb_per_s=64.0,  # PCIe Gen5 x16
    calibration=hero_calibration,
)

h200_sxm = dataclasses.replace(h100_sxm, name="H200 SXM (HGX, InfiniBand)", hbm_per_device_gb=141.0, hbm_gb_per_s=4800.0)

b200_hgx = dataclasses.replace(
    h100_sxm,
    name="B200 (HGX, InfiniBand)",
    hbm_per_device_gb=180.0,
    peak_flops_per_device=2.25e15,
    hbm_gb_per_s=7700.0,
    link_gb_per_s=900.0,  # NVLink 5
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
`--xla_force_host_platform_device_count` set to its topology's device count (2 racks x 4 = 8).
A CPU without AVX512-BF16 or AMX has no bf16 arithmetic: XLA:CPU converts around each bf16 op,
so a run declared in bf16 (the hero twin) steps slower than in float32 on it: tiny_moe 1.09x
(177 against 163 ms a step, interleaved), 1.35x while the attention softmax was bf16 too; the
tutorials declare `compute_dtype="float32"`."""
