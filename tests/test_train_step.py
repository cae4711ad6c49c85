"""The training step's declaration: identity vs execution-only fields, early errors, data batches."""

import dataclasses

import numpy as np
import pytest

from defaults import default_train
from defaults.models import tiny_moe
from keel import External, this_output
from keel.spec import AdamWConfig, Mixture, MixturePhase, RackTopology, TopologyError, TrainConfig, TransportPhase
from keel.executor.identity import Identities
from keel.spec.resolved import resolve

CACHE = External("test/cache", "/nowhere/cache")


def _train(**changes):
    base = TrainConfig(batch_size=16, seq_len=64, num_steps=20, optimizer=AdamWConfig(lr=1e-3), seed=3)
    return dataclasses.replace(base, **changes)


def _hash(step):
    return Identities().hash(step)


def test_identity_ignores_execution_only_fields_and_tracks_the_rest():
    base = default_train("t", data=CACHE, model=tiny_moe, train=_train())
    same = default_train(
        "t",
        data=CACHE,
        model=tiny_moe,
        train=_train(
            transports=(TransportPhase(0, "local"), TransportPhase(10, "ring")),  # dropless: see the next test
            permanent_checkpoint_every=5,
            rolling_checkpoint_minutes=1.0,
            log_every=3,
            eval_batches=9,
            eval_every=7,
            remat=False,
        ),
        topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4),
    )
    assert _hash(same) == _hash(base)
    for changed in (_train(seed=4), _train(num_steps=21), _train(batch_size=32), _train(seq_len=128),
                    _train(optimizer=AdamWConfig(lr=2e-3)), _train(z_loss=1e-4),
                    _train(compute_dtype="float32"), _train(master_dtype="bfloat16")):  # precision changes the weights
        assert _hash(default_train("t", data=CACHE, model=tiny_moe, train=changed)) != _hash(base)
    other_model = default_train("t", data=CACHE, model=tiny_moe.replace(num_layers=2), train=_train())
    assert _hash(other_model) != _hash(base)


def test_which_routed_assignments_the_run_drops_counts_toward_identity():
    """Transports and topology are execution-only, but a fixed-capacity transport drops the routed
    assignments past its capacity, counted on the expert-parallel and token shards: a capacity of
    0.5 drops half of them, another run and never the same one resumed. What decides no drop stays
    free to change."""
    racks = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)

    def run(*transports, topology=racks):
        return _hash(default_train("t", data=CACHE, model=tiny_moe, train=_train(transports=transports), topology=topology))

    fixed = run(TransportPhase(0, "fixed_all_to_all"), TransportPhase(10, "ring"))
    assert fixed != run() == run(TransportPhase(0, "ring"))  # the default timeline is dropless
    for other in (run(TransportPhase(0, "fixed_all_to_all", capacity_factor=0.5), TransportPhase(10, "ring")),
                  run(TransportPhase(0, "fixed_all_to_all"), TransportPhase(12, "ring")),  # two more steps drop
                  run(TransportPhase(0, "fixed_pooled_all_to_all"), TransportPhase(10, "ring")),
                  run(TransportPhase(0, "fixed_all_to_all"), TransportPhase(10, "ring"),
                      topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=2))):  # cells of other senders
        assert other != fixed
    for same in (run(TransportPhase(0, "fixed_all_to_all"), TransportPhase(10, "local")),  # dropless either way
                 run(TransportPhase(0, "fixed_all_to_all"), TransportPhase(5, "fixed_all_to_all", capacity_factor=1.25),
                     TransportPhase(10, "ring")),  # the same rule, said twice
                 run(TransportPhase(0, "fixed_all_to_all"), TransportPhase(10, "ring"),
                     topology=RackTopology(racks=1, gpus_per_rack=8, expert_parallel=4))):  # the same shards
        assert same == fixed
    pooled = TransportPhase(0, "fixed_pooled_all_to_all")
    assert run(pooled) != run(dataclasses.replace(pooled, num_waves=3))


def _resolve(step):
    from keel.spec.resolved import resolve

    return resolve(step.config, step.name)


def test_bad_declarations_are_refused_by_the_one_validator_before_any_compute():
    from keel.spec import PlanError

    with pytest.raises(PlanError, match="train.seq_len=256 exceeds model.max_seq_len=128"):
        _resolve(default_train("t", data=CACHE, model=tiny_moe, train=_train(seq_len=256)))
    with pytest.raises(PlanError, match="batch_size=12 is not divisible by the 8 batch shards"):
        _resolve(default_train("t", data=CACHE, model=tiny_moe, train=_train(batch_size=12),
                               topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)))
    with pytest.raises(TypeError, match="give a keel.spec.Mixture"):
        default_train("t", data="/some/path", model=tiny_moe, train=_train())
    phased = Mixture({"a": CACHE}, (MixturePhase(0, {"a": 1.0}), MixturePhase(3, {"a": 1.0})), block_size=64)
    with pytest.raises(PlanError, match="not a multiple of block_size=64"):
        _resolve(default_train("t", data=phased, model=tiny_moe, train=_train()))
    with pytest.raises(PlanError, match=r"transports\[0\].transport='ring' moves tokens over the expert axis, but "
                                        "topology.expert_parallel=1"):
        _resolve(default_train("t", data=CACHE, model=tiny_moe, train=_train(transports=(TransportPhase(0, "ring"),)),
                               topology=RackTopology(racks=2, gpus_per_rack=4)))


def test_transports_the_platform_or_mesh_cannot_run_are_refused():
    from defaults.hardware import cpu_sim
    from keel.spec import PlanError

    with pytest.raises(PlanError, match="'ragged_all_to_all' is not supported by hardware 'simulated CPU racks'"):
        _resolve(default_train("t", data=CACHE, model=tiny_moe, hardware=cpu_sim, train=_train(
            transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(5, "ragged_all_to_all"))),
            topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)))
    from keel.spec.train import TrainStepConfig
    from keel.train.step import check_step_config

    racks = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
    ragged = TrainStepConfig(model=tiny_moe, data=CACHE, train=_train(
        transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(5, "ragged_all_to_all"))))
    on_racks = resolve(dataclasses.replace(ragged, topology=racks))
    with pytest.raises(ValueError, match="ragged_all_to_all.*needs a GPU or TPU"):
        check_step_config(on_racks, num_devices=8, platform="cpu")
    check_step_config(on_racks, num_devices=8, platform="gpu")
    with pytest.raises(TopologyError, match="8 devices are present but racks=1 x gpus_per_rack=4"):
        check_step_config(resolve(dataclasses.replace(ragged, topology=RackTopology(racks=1, gpus_per_rack=4,
                                                                                    expert_parallel=4))),
                          num_devices=8, platform="gpu")


def _cache(root, values, seq_len):
    from levanter.store.cache import SerialCacheWriter

    exemplar = {"input_ids": np.zeros((0,), np.int32), "segment_ids": np.zeros((0,), np.int32)}
    with SerialCacheWriter(f"{root}/train", exemplar) as writer:
        ids = np.repeat(np.array(values, np.int32)[:, None], seq_len, axis=1)
        writer.write_batch({"input_ids": ids, "segment_ids": np.zeros_like(ids)})
    return str(root)


def test_mixture_phase_switches_at_the_declared_step_in_the_training_batches(tmp_path):
    """The loop's own loader: steps 0-2 read only component a, steps 3+ only b, also after a resume."""
    from train_standin import BATCH_AXES, rack_mesh

    from keel.train.batches import batch_loader, training_datasets

    seq_len, batch = 16, 8
    a = _cache(tmp_path / "a", range(100, 164), seq_len)
    b = _cache(tmp_path / "b", range(200, 264), seq_len)
    mixture = Mixture({"a": a, "b": b}, (MixturePhase(0, {"a": 1.0}), MixturePhase(3, {"b": 1.0})), block_size=batch)
    train_data, _ = training_datasets(mixture, seq_len=seq_len, batch_size=batch, seed=0)
    mesh = rack_mesh()

    def batches_from(step, n):
        it = batch_loader(train_data, batch_size=batch, mesh=mesh, batch_axes=BATCH_AXES).iter_from_step(step)
        out = [np.asarray(next(it)["input_ids"])[:, 0] for _ in range(n)]
        it.close()
        return out

    first = batches_from(0, 6)
    assert [set(v // 100) for v in first] == [{1}, {1}, {1}, {2}, {2}, {2}]
    resumed = batches_from(3, 3)
    assert all(np.array_equal(x, y) for x, y in zip(resumed, first[3:]))


def test_non_finite_numbers_are_refused_at_declaration():
    from keel.executor.step import StepDeclarationError

    with pytest.raises(StepDeclarationError, match=r"config\.train\.optimizer\.lr=inf is not a finite number"):
        default_train("t", data=CACHE, model=tiny_moe, train=_train(optimizer=AdamWConfig(lr=float("inf"))))
    with pytest.raises(StepDeclarationError, match=r"config\.train\.z_loss=nan"):
        default_train("t", data=CACHE, model=tiny_moe, train=_train(z_loss=float("nan")))


def test_training_steps_run_isolated_with_the_devices_their_hardware_declares(monkeypatch):
    from defaults.hardware import cpu_sim, gb200_nvl72

    racks = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
    step = default_train("t", data=CACHE, model=tiny_moe, train=_train(), topology=racks, hardware=cpu_sim)
    assert step.isolated
    env = step.config.process_env()
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"].split()[-1] == "--xla_force_host_platform_device_count=8"
    three = RackTopology(racks=3, gpus_per_rack=4, expert_parallel=4)
    three_racks = default_train("t", data=CACHE, model=tiny_moe, train=_train(batch_size=48), topology=three, hardware=cpu_sim)
    assert three_racks.config.process_env()["XLA_FLAGS"].endswith("=12")
    # real accelerators are found as they are: what a CPU run left in the launcher's shell is dropped,
    # and nothing else is set (a cluster worker's own flags stand)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/dump")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert gb200_nvl72.process_env(64) == {"XLA_FLAGS": "--xla_dump_to=/tmp/dump", "JAX_PLATFORMS": ""}
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert gb200_nvl72.process_env(64) == {}


def test_set_decodes_nested_configs_by_their_declared_types():
    from keel.executor.overrides import apply_overrides

    step = default_train("t", data=CACHE, model=tiny_moe, train=_train())
    (changed,) = apply_overrides([step], [step], [
        "train/t.train.transports=[{start_step: 0, transport: fixed_all_to_all}, {start_step: 5, transport: ring}]",
        "train/t.model.routing=sigmoid_topk_threshold", "train/t.train.permanent_checkpoint_every=None"])
    assert changed.config.train.transports == (TransportPhase(0, "fixed_all_to_all"), TransportPhase(5, "ring"))
    assert changed.config.train.permanent_checkpoint_every is None


@dataclasses.dataclass(frozen=True)
class _Point:
    n: int


@dataclasses.dataclass(frozen=True)
class _Points:
    points: list[_Point]
    single: _Point
    output_path: str = this_output()


def _points(config: _Points) -> None:
    pass


def test_set_decodes_a_list_of_configs_and_refuses_a_plain_value_for_a_config():
    """A list of configs is a mapping each, not a config given one plain value (which is refused)."""
    from keel import Step
    from keel.executor.overrides import OverrideError, apply_overrides

    step = Step("p/points", _points, _Points(points=[_Point(1)], single=_Point(1)))
    (changed,) = apply_overrides([step], [step], ["p/points.points=[{n: 2}, {n: 3}]"])
    assert changed.config.points == [_Point(2), _Point(3)]
    with pytest.raises(OverrideError, match=r"single is a config \(_Point\), not one value"):
        apply_overrides([step], [step], ["p/points.single=4"])
