"""keel.mesh: rack topology and hardware, as plain configs (the JAX mesh is built where a step runs)."""

from keel.mesh.hardware import Hardware, StepTimeCalibration
from keel.mesh.topology import BATCH_AXES, MESH_AXES, RackTopology, TopologyError

__all__ = ["BATCH_AXES", "MESH_AXES", "Hardware", "RackTopology", "StepTimeCalibration", "TopologyError"]
