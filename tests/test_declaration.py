"""The declaration layer: values derived from others resolve from the final config (after `--set`),
and the steps that read a run follow it."""

from __future__ import annotations

import pytest

from keel.cli import load_experiment
from keel.executor.graph import topological_order
from keel.executor.overrides import apply_overrides
from keel.plan import fact_sheet, render_fact_sheet

SWEEP = "experiments/tutorials/lr_sweep.py"


def _step(steps, name):
    return next(s for s in topological_order(steps) if s.name == name)


def test_set_num_steps_changes_the_learning_rates_the_plan_prints():
    """The LR law is a rule in the optimizer: 100x the steps gives the law's rate at 100x the tokens;
    the evaluation cadence declared as a count follows too."""
    from keel.executor.overrides import OverrideError
    from defaults.models import tiny_moe
    from defaults.optimizers import hero_lr_law

    targets = load_experiment(SWEEP)
    before = fact_sheet(_step(targets, "train/lr_sweep/lr1.0").config, "lr1.0")
    notes = []
    after_targets = apply_overrides(targets, topological_order(targets), ["train/lr_sweep/lr1.0:train.num_steps=3000"], notes)
    assert notes == []  # the sweep declares no position after step 0: nothing stays behind
    after = fact_sheet(_step(after_targets, "train/lr_sweep/lr1.0").config, "lr1.0")
    tokens_per_step = 16 * 128
    for sheet, steps in ((before, 30), (after, 3000)):
        adam = hero_lr_law.adam_lr(tiny_moe.hidden_dim, tokens_per_step * steps, tokens_per_step)
        assert sheet["optimizer"]["adam_lr"] == pytest.approx(adam)
        assert sheet["optimizer"]["muon_lr"] == pytest.approx(adam * 13 / 3)
        assert sheet["optimizer"]["rates_from"] == "LR law x 1"
    assert round(after["optimizer"]["adam_lr"], 5) == 0.00422  # the law at 3,000 steps, not the declared 30
    trains = {s.name: s.config.train for s in topological_order(after_targets) if s.name.startswith("train/")}
    assert trains["train/lr_sweep/lr1.0"].eval_cadence == 1000 and trains["train/lr_sweep/lr0.5"].eval_cadence == 10
    with pytest.raises(OverrideError, match="eval_every=5 and evaluations=3 both set the evaluation cadence"):
        apply_overrides(targets, topological_order(targets), ["train/lr_sweep/lr1.0:train.eval_every=5"])
    assert "Adam 0.004224 (LR law x 1 at this size)" in render_fact_sheet(after)
    # the sweep's other points keep theirs, scaled
    half = fact_sheet(_step(after_targets, "train/lr_sweep/lr0.5").config, "lr0.5")
    assert half["optimizer"]["adam_lr"] == pytest.approx(before["optimizer"]["adam_lr"] / 2)


def test_set_names_the_step_before_a_colon_and_refuses_an_ambiguous_dotted_key():
    from keel.executor.overrides import OverrideError

    targets = load_experiment(SWEEP)
    order = topological_order(targets)
    with pytest.raises(OverrideError, match=r"write the step name, a colon, then the field: --set "
                                            r"train/lr_sweep/lr1\.0:train\.num_steps=3000"):
        apply_overrides(targets, order, ["train/lr_sweep/lr1.0.train.num_steps=3000"])
    # a dot-free name that alone prefixes the key is still read the old way
    (done,) = [s for s in topological_order(apply_overrides(targets, order, ["documents/stdlib.max_bytes=1000"]))
               if s.name == "documents/stdlib"]
    assert done.config.max_bytes == 1000
    with pytest.raises(OverrideError, match="given twice"):
        apply_overrides(targets, order, ["documents/stdlib.max_bytes=1000", "documents/stdlib:max_bytes=2000"])


def test_set_reads_texts_as_written_takes_a_configs_assignments_together_and_names_what_refuses():
    from keel.executor.overrides import OverrideError

    targets = load_experiment(SWEEP)
    order = topological_order(targets)

    def after(*assignments):
        return {s.name: s for s in topological_order(apply_overrides(targets, order, list(assignments)))}

    # a list of texts keeps each item as written (YAML would make `no` false and `1.10` the number 1.1)
    prompts = after("sample/lr_sweep/lr1.0:prompts=[no, 1.10, 0x1F]")["sample/lr_sweep/lr1.0"].config.prompts
    assert prompts == ("no", "1.10", "0x1F")
    with pytest.raises(OverrideError, match=r"prompts holds several texts: write them as a list, e\.g\. "
                                            r"sample/lr_sweep/lr1\.0:prompts=\[hello\]"):
        after("sample/lr_sweep/lr1.0:prompts=hello")  # it used to become ('h', 'e', 'l', 'l', 'o')
    # two fields a config checks against each other, set in either order
    for pair in (("eval_every=5", "evaluations=None"), ("evaluations=None", "eval_every=5")):  # declared: evaluations=3
        train = after(*(f"train/lr_sweep/lr1.0:train.{a}" for a in pair))["train/lr_sweep/lr1.0"].config.train
        assert (train.eval_every, train.evaluations) == (5, None)
    # a config given whole says what its own check refused; a field of a None config says to set it whole
    with pytest.raises(OverrideError, match=r"ScheduleConfig\.warmup_fraction=2\.0 must lie in \[0, 1\)"):
        after("train/lr_sweep/lr1.0:train.schedule={warmup_fraction: 2}")
    with pytest.raises(OverrideError, match=r"train\.spike_guard is None, so it has no field 'window': set it whole"):
        after("train/lr_sweep/lr1.0:train.spike_guard.window=10")
    # a dependent whose own check refuses what the change made of it is named, with how to change it too
    with pytest.raises(OverrideError, match=r"changes what eval/lr_sweep/lr1\.0 depends on, and eval/lr_sweep/lr1\.0 "
                                            r"refuses it: EvalConfig\.num_batches=None .* --set eval/lr_sweep/lr1\.0:FIELD="):
        after("train/lr_sweep/lr1.0:train.eval_batches=0")


def test_the_twin_derives_its_rates_from_the_heros_law_at_its_own_size():
    from defaults.optimizers import hero_lr_law

    (twin,) = load_experiment("experiments/hero_535b.py", scale="tiny")
    sheet = fact_sheet(twin.config, twin.name)
    t = sheet["training"]
    assert sheet["optimizer"]["adam_lr"] == pytest.approx(
        hero_lr_law.adam_lr(twin.config.model.hidden_dim, t["total_tokens"], t["tokens_per_step"]))


def test_the_twin_and_tiny_moe_declare_one_token_cache_under_two_names():
    """The twin's 'other' components are tiny_moe.py's cache: one content hash, so one output."""
    from keel.executor.identity import Identities

    (twin,) = load_experiment("experiments/hero_535b.py", scale="tiny")
    tiny = _step(load_experiment("experiments/tutorials/tiny_moe.py"), "tokenized/stdlib-bpe-1k-128")
    general = twin.config.data.components["other-main"]
    ids = Identities()
    assert general.name == "tokenized/hero-twin-general" and ids.hash(general) != ids.hash(tiny)
    assert ids.content_hash(general) == ids.content_hash(tiny)
    topics = [c for name, c in twin.config.data.components.items() if not name.startswith("other-")]
    assert all(ids.content_hash(c) != ids.content_hash(tiny) for c in topics)


def test_default_train_compares_the_resources_with_the_topology():
    from defaults import default_train, stdlib_tokens
    from defaults.models import tiny_moe
    from keel import Resources
    from keel.spec import RackTopology, TrainConfig

    racks = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
    train = TrainConfig(batch_size=16, num_steps=4)
    ok = default_train("t", data=stdlib_tokens(), model=tiny_moe, train=train, topology=racks,
                       resources=Resources.with_gpu("H100", 4, replicas=2))
    assert ok.config.train.seq_len == 128  # the length the data was tokenized at
    with pytest.raises(ValueError, match=r"4 GPUs x 3 replicas = 12, but the topology lays out 2 racks x 4 = 8"):
        default_train("t", data=stdlib_tokens(), model=tiny_moe, train=train, topology=racks,
                      resources=Resources.with_gpu("H100", 4, replicas=3))


def test_no_twin_topic_module_is_in_the_general_corpus_its_other_components_train_on():
    """Documents are held out by their id's hash (`split_of`), so a topic corpus holding out a quarter
    would validate on modules the general corpus (1% held out) trains on: the families leave out every
    package the general corpus reads."""
    from keel.data.stdlib_corpus import corpus_files

    (twin,) = load_experiment("experiments/hero_535b.py", scale="tiny")
    corpora = {name: cache.config.documents.config for name, cache in twin.config.data.components.items()}
    general = set(corpus_files(corpora.pop("other-main")))
    topics = {name: corpus_files(config) for name, config in corpora.items() if not name.startswith("other-")}
    assert len(topics) == 10 and all(topics.values()), topics
    assert {name: sorted(general & set(files)) for name, files in topics.items() if general & set(files)} == {}


@pytest.mark.parametrize("num_steps, evaluations", [(7, 4), (10, 3), (30, 8), (390_251, 6), (5, 5), (3, 10)])
def test_evaluations_evaluate_that_many_times_at_most_the_last_after_the_final_step(num_steps, evaluations):
    """The loop's own after-step hook, over every step of the run (the evaluation before the first
    step is the initial loss, not one of the N)."""
    from types import SimpleNamespace

    from keel.spec import TrainConfig
    from keel.train.loop import StepDone, _Run

    after: list[int] = []
    run = SimpleNamespace(config=TrainConfig(batch_size=1, seq_len=1, num_steps=num_steps, evaluations=evaluations),
                          _evaluate=lambda completed, phase: after.append(completed))
    for step in range(num_steps):
        _Run._evaluate_after(run, StepDone(step, phase=None, metrics={}, started=0.0))
    assert len(after) == min(evaluations, num_steps) and after[-1] == num_steps


def test_only_checks_the_fit_of_the_steps_it_selects(monkeypatch, capsys, tmp_path):
    """`--only` plans and runs the selected steps and their ancestry: a training step it leaves out
    neither prints a fact sheet nor stops the run by not fitting."""
    import keel
    import keel.cli

    reached = []
    monkeypatch.setattr(keel.cli, "_run", lambda args, graph, force, only: reached.append(only.pattern) or 0)
    unfit = ["--set", "train/lr_sweep/lr2.0:train.batch_size=65536", "--prefix", str(tmp_path)]
    steps = load_experiment(SWEEP)
    assert keel.main(steps, argv=["plan", "--only", r"lr1\.0", *unfit]) == 0
    printed = capsys.readouterr().out
    assert "== fact sheet: train/lr_sweep/lr1.0" in printed and "lr2.0" not in printed, printed
    assert keel.main(steps, argv=["run", "--only", r"lr1\.0", *unfit]) == 0 and reached == [r"lr1\.0"]
    for command in ("plan", "run"):  # the step that does not fit, selected, is refused before anything runs
        assert keel.main(steps, argv=[command, "--only", r"lr2\.0", *unfit]) == 2
        assert "train/lr_sweep/lr2.0: from step 0 the peak is" in capsys.readouterr().err
    assert reached == [r"lr1\.0"]



def test_stdlib_token_chains_that_differ_in_any_argument_are_other_steps():
    """Names used vocab_size // 1024: 512 was '0k', and 1024 and 1536 were one name (refused as two
    steps of one name), as were two max_bytes."""
    from defaults.data import stdlib_tokens
    from keel.executor.plan import Graph

    chains = [stdlib_tokens(), stdlib_tokens(vocab_size=512), stdlib_tokens(vocab_size=1536),
              stdlib_tokens(max_bytes=1_000_000), stdlib_tokens(seq_len=64)]
    names = [step.name for step in Graph(chains, "memory://stdlib-chains").order]
    assert len(names) == len(set(names)) == 2 + 4 + 5  # 2 corpora, 4 tokenizers (seq_len shares one), 5 caches
    assert [s.name for s in topological_order([chains[0]])] == ["documents/stdlib", "tokenizers/stdlib-bpe-1k",
                                                                "tokenized/stdlib-bpe-1k-128"]  # the tutorials' names, kept
