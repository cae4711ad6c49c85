"""RackTopology and Hardware: derived axis sizes for the hero and the CPU twin, and clear errors."""

import pytest

from defaults.hardware import cpu_sim, gb200_nvl72
from defaults.models import hero_535b, tiny_moe
from keel.spec import Hardware, RackTopology, TopologyError


def test_hero_topology_axes_and_per_gpu_shares():
    topo = RackTopology(racks=11, gpus_per_rack=gb200_nvl72.gpus_per_rack, expert_parallel=64)
    assert topo.axis_sizes == {"replica_dcn": 11, "data": 1, "expert": 64, "model": 1}
    assert topo.num_devices == 704
    assert topo.experts_per_device(hero_535b) == 6
    assert 11_264 // topo.batch_shards == 16
    topo.validate(hero_535b, global_batch=11_264, num_devices=704)


def test_cpu_twin_layouts():
    assert RackTopology(2, 4, expert_parallel=4).axis_sizes == {"replica_dcn": 2, "data": 1, "expert": 4, "model": 1}
    two = RackTopology(2, 4, expert_parallel=2)
    assert two.data == 2 and two.batch_shards == 8
    two.validate(tiny_moe, global_batch=16, num_devices=8)


@pytest.mark.parametrize(
    "topology, model, batch, devices, field",
    [
        (RackTopology(2, 4, expert_parallel=4), tiny_moe, 16, 6, "gpus_per_rack"),
        (RackTopology(2, 4, expert_parallel=4), tiny_moe, 14, 8, "batch_size"),
        (RackTopology(10, 64, expert_parallel=64), hero_535b, 11_264, None, "batch_size"),
    ],
)
def test_validate_names_the_field(topology, model, batch, devices, field):
    with pytest.raises(TopologyError, match=field):
        topology.validate(model, batch, devices)


def test_experts_must_divide_over_the_expert_axis():
    topo = RackTopology(1, 8, expert_parallel=8)
    topo.validate(tiny_moe, 8)
    with pytest.raises(TopologyError, match=r"expert_parallel=8 does not divide MoELMConfig.num_experts=6"):
        topo.validate(tiny_moe.replace(num_experts=6), 8)


def test_expert_parallelism_stays_inside_a_rack():
    with pytest.raises(TopologyError, match=r"expert_parallel=8 .* larger than a rack"):
        RackTopology(2, 4, expert_parallel=8)
    with pytest.raises(TopologyError, match=r"must divide gpus_per_rack=4"):
        RackTopology(2, 4, expert_parallel=3)


def test_hardware_presets():
    assert gb200_nvl72.hbm_per_rack_gb == 64 * 192
    assert gb200_nvl72.physical_gpus_per_rack == 72
    assert gb200_nvl72.supports_transport("ragged_all_to_all")
    assert not cpu_sim.supports_transport("ragged_all_to_all")
    assert cpu_sim.supports_transport("fixed_all_to_all")
    with pytest.raises(ValueError, match="gpus_per_rack=80 exceeds physical_gpus_per_rack=72"):
        Hardware("x", gpus_per_rack=80, physical_gpus_per_rack=72, hbm_per_device_gb=1)
