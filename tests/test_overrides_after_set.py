"""`--set` values are checked as the declaration is: against the step's resources, against the
field's declared type, and with derived values (a left-out seq_len) resolved again."""

import dataclasses

import pytest

from keel.cli import load_experiment
from keel.executor.graph import topological_order
from keel.executor.overrides import OverrideError, apply_overrides

HERO = "experiments/hero_535b.py"
TINY = "experiments/tutorials/tiny_moe.py"


def _after(path: str, *assignments: str) -> dict:
    targets = load_experiment(path)
    return {s.name: s for s in topological_order(apply_overrides(targets, topological_order(targets), list(assignments)))}


def test_a_topology_the_resources_cannot_run_is_refused_naming_the_field_and_the_fix():
    """8 racks of 64 are 512 GPUs; the step's resources still start 4 x 176 = 704: dispatch would fail."""
    with pytest.raises(OverrideError, match=r"--set train/hero_535b:topology\.racks=8: resources ask for 4 GPUs x 176 "
                                            r"replicas = 704, but the topology lays out 8 racks x 64 = 512: declare "
                                            r"Resources\.with_gpu\('GB200', 4, replicas=128\)"):
        _after(HERO, "train/hero_535b:topology.racks=8")
    assert _after(HERO, "train/hero_535b:topology.expert_parallel=32")["train/hero_535b"].config.topology.num_devices == 704


@pytest.mark.parametrize("assignment, field", [("model.num_layers=yes", "num_layers"), ("model.capacity_factor=on", "capacity_factor"),
                                               ("train.seed=true", "seed")])
def test_a_yaml_boolean_is_refused_for_a_number_field(assignment, field):
    """YAML reads yes/on/true as a bool, which draccus would turn into 1 (one layer)."""
    value = assignment.partition("=")[2]
    with pytest.raises(OverrideError, match=rf"YAML reads '{value}' as the boolean true, but {field} is declared "
                                            rf"(int|float), .*e\.g\. train/hero_535b:{assignment.partition('=')[0]}=1"):
        _after(HERO, f"train/hero_535b:{assignment}")
    assert _after(HERO, "train/hero_535b:train.remat=no")["train/hero_535b"].config.train.remat is False  # a bool field


def test_a_left_out_seq_len_follows_a_set_on_the_tokenize_step_and_a_declared_one_stays_refused():
    """tiny_moe leaves train.seq_len out: it is the length its data are tokenized at, after --set too."""
    from keel.spec import PlanError
    from keel.spec.checks import check_train_step

    train = _after(TINY, "tokenized/stdlib-bpe-1k-128:seq_len=64")["train/tiny_moe"].config
    assert train.train.seq_len == 64
    check_train_step(train)  # what `keel plan` checks: the lengths agree
    declared = _after(TINY, "train/tiny_moe:train.seq_len=32")["train/tiny_moe"].config
    with pytest.raises(PlanError, match=r"train\.seq_len=32 differs from TokenizeConfig\.seq_len=128"):
        check_train_step(declared)
    both = _after(TINY, "train/tiny_moe:train.seq_len=32", "tokenized/stdlib-bpe-1k-128:seq_len=64")["train/tiny_moe"].config
    with pytest.raises(PlanError, match=r"train\.seq_len=32 differs from TokenizeConfig\.seq_len=64"):
        check_train_step(both)


def test_a_derived_seq_len_survives_the_config_the_running_step_gets():
    """The running step's config holds its data as paths, which no longer say their length: the
    length derived at declaration stays (the twin's step failed on it: 'seq_len is not declared')."""

    from keel.executor.resolve import resolve_config

    train = _after(TINY)["train/tiny_moe"]
    resolved = resolve_config(train.config, "/tmp/out/train/tiny_moe-x", lambda step: f"/tmp/out/{step.name}")
    assert resolved.train.seq_len == 128 and dataclasses.replace(resolved, facts=None).train.seq_len == 128


def test_resources_of_more_gpus_per_replica_than_a_host_holds_are_refused():
    """8 GPUs x 88 replicas start 704 GPUs, as the topology lays out, but a GB200 host holds 4: the
    host RAM figures (per host of 4) and the dispatch would disagree."""
    from keel import Resources

    hero = _after(HERO)["train/hero_535b"]
    assert hero.config.resources_problem(hero.resources) is None
    problem = hero.config.resources_problem(Resources.with_gpu("GB200", 8, replicas=88))
    assert problem == ("resources ask for 8 GPUs per replica, but hardware.gpus_per_host=4 (GB200 NVL72): a replica is "
                       "one host; declare Resources.with_gpu('GB200', 4, replicas=176) with the step")


def test_replicas_without_a_topology_are_refused_naming_it():
    """Without a topology a run lays its devices out as one rack; across replicas (hosts) that puts
    the expert and FSDP axes on the slow link between them."""
    from keel import Resources

    tiny = _after(TINY)["train/tiny_moe"]
    unlaid = dataclasses.replace(tiny.config, topology=None)
    assert unlaid.resources_problem(Resources(cpu=1)) is None  # one process: its devices are one rack
    problem = unlaid.resources_problem(Resources(cpu=1, replicas=2))
    assert problem.startswith("resources ask for 2 replicas, but no topology is declared") and "RackTopology(" in problem
