"""Mixtures: declaration errors, external components, Levanter mixture datasets over phases, and the
token-cache reader under them."""

import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from levanter.data.dataset import AsyncDataset
from levanter.data.mixture import MixtureDataset

from keel import External, Step
from keel.data import build_train_dataset, build_validation_datasets, load_token_cache
from keel.data.cache_files import CONSOLIDATED, LEDGER_FILE
from keel.data.datasets import StoredSequences
from keel.spec import Mixture, MixtureError, MixturePhase
from keel.executor.plan import EXTERNAL, Graph, plan_graph


class Draws(AsyncDataset):
    """An endless stand-in for a mixture component whose sequence i is (its name, i): what
    Levanter's MixtureDataset reads of each component, seen through its public `get_batch`."""

    def __init__(self, name: str):
        self.name = name

    async def async_len(self) -> int:
        raise TypeError("an endless dataset has no length")

    def is_finite(self) -> bool:
        return False

    async def get_batch(self, indices):
        return [(self.name, int(i)) for i in indices]


def levanter_draws(mixture: Mixture, batch_size: int, first: int, count: int) -> list[tuple[str, int]]:
    """(component, index read) of sequences first..first+count of Levanter's mixture of `mixture`."""
    components = {name: Draws(name) for name in mixture.components}
    levanter = MixtureDataset(components, mixture.sequence_schedule(batch_size), block_size=mixture.block_size, key=0)
    return asyncio.run(levanter.get_batch(list(range(first, first + count))))


SEQ_LEN = 8


def _mixture(*phases, **kwargs):
    return Mixture({"a": "/a", "b": "/b"}, tuple(MixturePhase(s, w) for s, w in phases), **kwargs)


@pytest.mark.parametrize(
    "phases, kwargs, message",
    [
        ([(0, {"a": 0.5, "b": -0.5})], {}, r"phase 0 \(start_step=0\): component 'b' has weight -0.5"),
        ([(0, {"a": 0.5, "b": 0.4})], {}, r"phase 0 \(start_step=0\): weights sum to 0.9, not 1.*normalize=True"),
        ([(0, {"a": 1.0}), (10, {"a": 2.0})], {}, r"phase 1 \(start_step=10\): weights sum to 2"),
        ([(0, {"a": 0.0, "b": 0.0})], {"normalize": True}, "at least one component needs a positive weight"),
        ([(5, {"a": 1.0})], {}, "the first phase must start at step 0"),
        ([(0, {"a": 1.0}), (10, {"b": 1.0}), (10, {"a": 1.0})], {}, r"phase 2 \(start_step=10\): phase starts must strictly increase"),
        ([(0, {"c": 1.0})], {}, r"weight for unknown component 'c'; components: \['a', 'b'\]"),
        ([(0, {"a": float("nan"), "b": 1.0})], {}, "component 'a' has weight nan"),
        ([(0, {"a": float("inf"), "b": 1.0})], {"normalize": True}, "component 'a' has weight inf; weights must be finite"),
        ([(0, {"a": 0.9996, "b": 0.0004})], {"block_size": 2048},
         r"component 'b' has 0.0004 of the weight, less than one sequence of a block of 2048.*at least 2501"),
        ([], {}, "Mixture.phases is empty"),
        ([(0, {"a": 1.0})], {"block_size": 2**16}, "block_size must be in"),
    ],
)
def test_mixture_declaration_errors_name_the_phase_and_component(phases, kwargs, message):
    with pytest.raises(MixtureError, match=message):
        _mixture(*phases, **kwargs)


def test_a_share_of_exactly_one_sequence_that_levanter_rounds_to_none_is_refused():
    """1 of 104 after normalising twice (keel's phase weights, then Levanter's) is 0.99999... of a
    sequence: Levanter draws it 0 times a block, so the check uses Levanter's own arithmetic."""
    components = {name: f"/{name}" for name in ("a", "b0", "b1", "b2")}
    weights = {"a": 1.0, "b0": 103 / 3, "b1": 103 / 3, "b2": 103 / 3}
    with pytest.raises(MixtureError, match=r"component 'a' has 0.00962 of the weight, less than one sequence of a "
                       r"block of 104 as Levanter rounds it.*at least 105"):
        Mixture.constant(components, weights, normalize=True, block_size=104)
    assert Mixture.constant(components, weights, normalize=True, block_size=105).block_counts()[0]["a"] == 1


def test_normalize_rescales_each_phase_and_fills_missing_components():
    mixture = _mixture((0, {"a": 3.0, "b": 1.0}), (100, {"b": 2.0}), normalize=True, block_size=400)
    assert mixture.phase_weights() == [(0, {"a": 0.75, "b": 0.25}), (100, {"a": 0.0, "b": 1.0})]
    assert mixture.sequence_schedule(batch_size=4) == [(0, {"a": 0.75, "b": 0.25}), (400, {"a": 0.0, "b": 1.0})]
    with pytest.raises(MixtureError, match="Mixture.components is empty"):
        Mixture.constant({}, {})


def test_hero_phases_over_external_cells_check_the_block_boundary():
    cells = {f"cell-{i:03d}": External(f"hero/data/cell-{i:03d}", f"gs://bucket/cache/cell-{i:03d}", version="v1")
             for i in range(200)}
    shares = [np.random.default_rng(p).dirichlet(np.full(200, 50.0)) for p in range(3)]  # every cell drawn in a block
    phases = tuple(MixturePhase(start, {name: float(w) for name, w in zip(cells, share, strict=True)})
                   for start, share in zip((0, 108_000, 312_192), shares, strict=True))
    mixture = Mixture(cells, phases, normalize=True, block_size=49_152)

    mixture.check_batch_size(11_264)  # 108,000 x 11,264 = 24,750 blocks; 312,192 x 11,264 = 71,544 blocks
    assert [start for start, _ in mixture.sequence_schedule(11_264)] == [0, 108_000 * 11_264, 312_192 * 11_264]
    with pytest.raises(MixtureError, match=r"phase 1 starts at step 108000, sequence 432000 at batch size 4"):
        mixture.check_batch_size(4)

    def train(config):
        raise AssertionError("planning runs nothing")

    step = Step("hero/train", train, mixture)
    plans = {p.name: p for p in plan_graph(Graph([step], "/tmp/keel-plan-only"))}
    assert plans["hero/data/cell-007"].state == EXTERNAL
    assert plans["hero/data/cell-007"].output_path == "gs://bucket/cache/cell-007"
    assert len([p for p in plans.values() if p.state == EXTERNAL]) == 200


EXEMPLAR = {"input_ids": np.zeros((0,), np.int32), "segment_ids": np.zeros((0,), np.int32)}


def _write_cache(root, split, values):
    """A token cache whose sequence i is SEQ_LEN copies of values[i]: items name their source."""
    from levanter.store.cache import SerialCacheWriter

    with SerialCacheWriter(f"{root}/{split}", EXEMPLAR) as writer:
        ids = np.repeat(np.array(values, np.int32)[:, None], SEQ_LEN, axis=1)
        if len(ids):
            writer.write_batch({"input_ids": ids, "segment_ids": np.zeros_like(ids)})
    return str(root)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("caches")
    a = _write_cache(root / "a", "train", range(1000, 1040))
    _write_cache(root / "a", "validation", [1999])
    b = _write_cache(root / "b", "train", range(2000, 2040))
    _write_cache(root / "b", "validation", [])
    return a, b


def _items(dataset, n):
    return np.array([int(item["input_ids"][0]) for item in dataset.as_sync_dataset().get_batch(list(range(n)))])


def test_train_dataset_switches_phase_at_the_declared_step_and_is_deterministic_per_seed(caches):
    a, b = caches
    batch_size = 8
    mixture = Mixture({"a": a, "b": b},
                      (MixturePhase(0, {"a": 1.0}), MixturePhase(3, {"a": 0.25, "b": 0.75})), block_size=8)

    dataset = build_train_dataset(mixture, seq_len=SEQ_LEN, batch_size=batch_size, seed=0)
    items = _items(dataset, 10 * batch_size)

    assert all(1000 <= v < 1040 for v in items[: 3 * batch_size])  # steps 0-2: all a
    later = items[3 * batch_size :].reshape(-1, 8)  # one block per step from step 3: exactly 2 a and 6 b
    assert ((later >= 1000) & (later < 1040)).sum(axis=1).tolist() == [2] * 7
    assert len(set(items[: 3 * batch_size].tolist())) == 3 * batch_size  # a shuffled pass, no repeats
    assert items[:24].tolist() != list(range(1000, 1024))

    assert np.array_equal(items, _items(build_train_dataset(mixture, seq_len=SEQ_LEN, batch_size=batch_size, seed=0), 80))
    assert not np.array_equal(items, _items(build_train_dataset(mixture, seq_len=SEQ_LEN, batch_size=batch_size, seed=1), 80))
    item = dataset.as_sync_dataset()[0]
    assert set(item) == {"input_ids", "segment_ids"} and item["input_ids"].shape == (SEQ_LEN,)


def test_validation_datasets_and_sequence_length_checks(caches):
    a, b = caches
    mixture = Mixture.constant({"a": a, "b": b}, {"a": 0.5, "b": 0.5})
    validation = build_validation_datasets(mixture, seq_len=SEQ_LEN)
    assert list(validation) == ["a"] and int(validation["a"][0]["input_ids"][0]) == 1999
    with pytest.raises(ValueError, match="holds sequences of 8 tokens, not 16"):
        build_train_dataset(mixture, seq_len=16, batch_size=4, seed=0)
    with pytest.raises(TypeError, match="pass the mixture as the step function received it"):
        build_train_dataset(Mixture.constant({"a": External("x/a", "/a")}, {"a": 1.0}), seq_len=8, batch_size=4, seed=0)


def test_an_evaluation_only_component_needs_no_train_split(caches, tmp_path):
    a, _ = caches
    held_out = _write_cache(tmp_path / "held_out", "validation", [3000])  # a validation split alone
    mixture = Mixture.constant({"a": a, "held_out": held_out}, {"a": 1.0, "held_out": 0.0})
    items = _items(build_train_dataset(mixture, seq_len=SEQ_LEN, batch_size=8, seed=0), 16)
    assert all(1000 <= v < 1040 for v in items)
    assert sorted(build_validation_datasets(mixture, seq_len=SEQ_LEN)) == ["a", "held_out"]


def test_adding_a_component_keeps_the_other_components_orders(caches):
    a, b = caches
    alone = Mixture.constant({"b": b}, {"b": 1.0}, block_size=8)
    joined = Mixture.constant({"a": a, "b": b}, {"a": 0.0, "b": 1.0}, block_size=8)
    items = _items(build_train_dataset(alone, seq_len=SEQ_LEN, batch_size=8, seed=3), 40)
    assert np.array_equal(items, _items(build_train_dataset(joined, seq_len=SEQ_LEN, batch_size=8, seed=3), 40))
    assert sorted(items.tolist()) == list(range(2000, 2040))


def test_a_split_reads_as_levanters_tree_cache_reads_it(caches):
    from levanter.store.cache import CACHE_LAYOUT_CONSOLIDATED, LEDGER_FILE_NAME, TreeCache

    assert (LEDGER_FILE, CONSOLIDATED) == (LEDGER_FILE_NAME, CACHE_LAYOUT_CONSOLIDATED)
    a, _ = caches
    ours, levanters = load_token_cache(a, "train", seq_len=SEQ_LEN), TreeCache.load(f"{a}/train", EXEMPLAR)
    assert isinstance(ours, StoredSequences) and len(ours) == len(levanters) == 40
    rows = [39, 0, 17, 17, 5]
    for got, want in zip(ours.as_sync_dataset().get_batch(rows), levanters.as_sync_dataset().get_batch(rows), strict=True):
        assert set(got) == set(want) and all(np.array_equal(got[f], want[f]) for f in want)
    assert [int(ours[i]["input_ids"][0]) for i in (0, 39)] == [1000, 1039]


def test_an_unfinished_split_is_refused_and_a_sharded_one_goes_to_levanters_reader(caches, tmp_path, monkeypatch):
    a, _ = caches
    copy = shutil.copytree(a, tmp_path / "a")
    ledger_path = copy / "train" / LEDGER_FILE
    ledger = json.loads(ledger_path.read_text())
    ledger_path.write_text(json.dumps({**ledger, "is_finished": False}))
    with pytest.raises(FileNotFoundError, match=f"{copy}/train is not finished .*{LEDGER_FILE}.*rerun the step"):
        load_token_cache(str(copy), "train", seq_len=SEQ_LEN)
    ledger_path.unlink()
    with pytest.raises(FileNotFoundError, match="is not finished"):
        load_token_cache(str(copy), "train", seq_len=SEQ_LEN)

    import levanter.store.cache

    loaded = []
    monkeypatch.setattr(levanter.store.cache.TreeCache, "load", staticmethod(lambda path, exemplar: loaded.append(path) or []))
    ledger_path.write_text(json.dumps({**ledger, "layout": levanter.store.cache.CACHE_LAYOUT_SHARDED}))
    assert load_token_cache(str(copy), "train", seq_len=SEQ_LEN) == [] and loaded == [f"{copy}/train"]


def test_the_training_and_evaluation_steps_import_no_cache_builder():
    """Reading caches needs Levanter's store, not the builder's distributed pipeline: zephyr and the
    iris client cost each training or eval process 0.8 s of its start."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    code = ("import sys, keel.train.step, keel.trained.evaluate; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'zephyr', 'iris'}), 'levanter.store.cache' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "[] False"


def test_the_block_counts_are_what_levanters_mixture_draws():
    from keel.cli import load_experiment

    (twin,) = load_experiment("experiments/hero_535b.py", scale="tiny")
    rng = np.random.default_rng(0)
    names = [f"c{i}" for i in range(9)]
    mixtures = [(twin.config.data, twin.config.train.batch_size)] + [
        (Mixture(dict.fromkeys(names, "/c"), (MixturePhase(0, {n: float(w) for n, w in zip(names, rng.dirichlet(np.ones(9) * 3))}),),
                 normalize=True, block_size=int(rng.integers(64, 4096))), 1)
        for _ in range(20)]
    for mixture, batch in mixtures:
        for (start, _), counts in zip(mixture.sequence_schedule(batch), mixture.block_counts(), strict=True):
            drawn = collections.Counter(name for name, _ in levanter_draws(mixture, batch, start, mixture.block_size))
            assert counts == {name: drawn[name] for name in counts}, (mixture, start)


def test_a_phase_after_a_component_served_2_to_the_31_sequences_is_refused_where_levanter_would_wrap():
    """Levanter's MixtureDataset counts each component's sequences before a phase in int32 and starts
    the phase's reads there: at 2**31 it wraps, and the phase silently rereads trained data."""
    def mixture(phase_step: int) -> Mixture:
        return Mixture({"a": "gs://a", "b": "gs://b"}, (MixturePhase(0, {"a": 1.0}),
                                                        MixturePhase(phase_step, {"b": 1.0}),
                                                        MixturePhase(phase_step + 4, {"a": 1.0})))

    batch = 2048  # a step is one block of 2,048 sequences
    served = {"below": 2**20 - 1, "at": 2**20}  # blocks of "a" alone: 2**31 - 2048 and 2**31 sequences
    mixture(served["below"]).check_read_counts(batch)
    with pytest.raises(MixtureError, match=r"component 'a' has served 2,147,483,648 sequences when phase 1 starts "
                                           r"\(step 1,048,576\), past the 2,147,483,648"):
        mixture(served["at"]).check_read_counts(batch)
    first_read = {}  # of "a" in phase 2, as Levanter's mixture reads it
    for case, step in served.items():
        drawn = levanter_draws(mixture(step), batch, (step + 4) * batch, batch)
        first_read[case] = min(index for name, index in drawn if name == "a")
    assert first_read == {"below": 2**31 - 2048, "at": -(2**31)}, first_read


def test_within_a_phase_the_batch_reads_go_past_2_to_the_31_without_wrapping():
    """Why only phase starts are bounded: the offset of a block inside a phase is its block id (an
    int64 in `get_batch`, which the loader reads through) times the per-block count, int64 too."""
    half = Mixture.constant({"a": "gs://a", "b": "gs://b"}, {"a": 0.5, "b": 0.5}, block_size=2048)
    drawn = levanter_draws(half, 1024, 2**21 * 2048, 2048)  # block 2**21 of the one phase
    assert min(index for name, index in drawn if name == "a") == 2**21 * 1024, "2**31 sequences into the phase, counted on"


def test_the_sequences_a_run_draws_from_each_component_follow_its_phases():
    from keel import External
    from keel.spec import Mixture, MixturePhase

    caches = {name: External(name, f"memory://{name}", version="1") for name in ("a", "b")}
    mixture = Mixture(caches, (MixturePhase(0, {"a": 1.0}), MixturePhase(10, {"a": 0.5, "b": 0.5})), block_size=8)
    assert mixture.sequences_drawn(batch_size=8, num_steps=10) == {"a": 80, "b": 0}
    assert mixture.sequences_drawn(batch_size=8, num_steps=20) == {"a": 120, "b": 40}
    assert mixture.sequences_drawn(batch_size=8, num_steps=5) == {"a": 40, "b": 0}  # the run ends inside phase 0
