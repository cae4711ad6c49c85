"""The reading side of keel's token caches: Levanter datasets over their splits and mixtures, and the
byte counts evaluation divides by (imports Levanter's store, not its cache builder).

The training helper calls `build_train_dataset` with a resolved `Mixture` (every component a cache
root path) and gets a Levanter `MixtureDataset` whose items are
`{"input_ids": int32[seq_len], "segment_ids": int32[seq_len]}`; item `i` belongs to training step
`i // batch_size`. The order is a pure function of the caches, the mixture and the seed.
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from levanter.data.dataset import AsyncDataset
from levanter.data.mixture import MixtureDataset, StopStrategy
from levanter.store.tree_store import TreeStore

from keel.data.arrays import read_array
from keel.data.cache_files import BYTES_FILE, CONSOLIDATED, LEDGER_FILE, STATS_FILE, has_split
from keel.executor import storage
from keel.spec.mixture import Mixture

FIELDS = ("input_ids", "segment_ids")
FORMAT = "keel.token_cache/v2"
"""The `format` in a keel token cache's tokenize.json. v2: each sequence's byte count
(`read_sequence_bytes`) is of the tokens the loss predicts; v1 counted every token's text."""
OPEN_THREADS = 8  # caches opened at once (`_each_component`)


def exemplar() -> dict:
    """One empty record of a keel token cache: the tree Levanter's writers and readers are given."""
    return {field: np.zeros((0,), dtype=np.int32) for field in FIELDS}


class StoredSequences(AsyncDataset[dict]):
    """One finished, consolidated split of a token cache (keel's are: Levanter's `SerialCacheWriter`
    writes one store), read through Levanter's `TreeStore` as Levanter's `TreeCache` reads it.

    `TreeCache` itself lives in `levanter.store.cache`, beside the cache builder, whose imports (zephyr's
    distributed pipeline, the iris client) cost a training or eval process 0.8 s before its first
    step, in which it only reads (a resume with the compilation cache then took about 6 s in all).

    A finished cache does not grow, so its stores keep their row counts once read
    (`cache_metadata`): without, every batch read first reads each array's row count from storage
    again. The twin's mixture (13 components) then read batches of 16 sequences in 9.1 ms each
    instead of 12.1 ms, on the loader's thread beside the training steps."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.store = TreeStore.open(exemplar(), path, mode="r", cache_metadata=True)

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> dict:
        return self.store[index]

    async def async_len(self) -> int:
        return len(self.store)

    def is_finite(self) -> bool:
        return True

    async def get_batch(self, indices) -> list[dict]:
        return await self.store.get_batch(indices)


def load_token_cache(cache_root: str, split: str, *, seq_len: int) -> AsyncDataset:
    """One split of a token cache as a Levanter dataset, checked against `seq_len`: keel's
    (consolidated) caches as `StoredSequences`, a sharded one Levanter built as its `TreeCache`."""
    stats = storage.read_json(storage.join(cache_root, STATS_FILE))
    if stats is not None and stats["seq_len"] != seq_len:
        raise ValueError(f"token cache {cache_root} holds sequences of {stats['seq_len']} tokens, not seq_len={seq_len}")
    path = storage.join(cache_root, split)
    ledger = storage.read_json(storage.join(path, LEDGER_FILE))
    if ledger is None or not ledger.get("is_finished"):
        raise FileNotFoundError(f"token cache {path} is not finished (its {LEDGER_FILE} is missing or says so): "
                                "rerun the step that writes it")
    if ledger.get("layout", CONSOLIDATED) == CONSOLIDATED:
        missing = [field for field in FIELDS if not storage.exists(storage.join(path, field))]
        if missing:  # e.g. a Levanter LM cache, input_ids only: unpacked, no document boundaries
            raise ValueError(f"token cache {path} has no {', '.join(missing)}: keel trains on packed sequences with "
                             f"{' and '.join(FIELDS)} (documents never attend across each other); tokenize the "
                             "documents with keel (defaults.default_tokenize) to make such a cache")
        cache = StoredSequences(path)
    else:
        from levanter.store.cache import TreeCache  # the builder's module: only for a cache it sharded

        cache = TreeCache.load(path, exemplar())
    if len(cache) and len(cache[0]["input_ids"]) != seq_len:
        raise ValueError(f"token cache {cache_root}/{split} holds sequences of {len(cache[0]['input_ids'])} tokens, not {seq_len}")
    return cache


def read_sequence_bytes(cache_root: str, split: str):
    """The UTF-8 bytes of each sequence's predicted tokens in a split (None for a cache written
    without them). A keel cache of an older format counted every token's text, which bits per byte
    would divide by too: refused, since the cache cannot be recounted without its tokenizer."""
    stats = storage.read_json(storage.join(cache_root, STATS_FILE))
    if stats is not None and stats.get("format") != FORMAT:
        raise ValueError(f"token cache {cache_root} ({stats.get('format')}) counted the bytes of every token, not of "
                         f"those the loss predicts ({FORMAT}): its bits per byte would be too low; rerun its tokenize "
                         "step with `keel run --force REGEX` (a regex matching the step's name)")
    return read_array(storage.join(cache_root, BYTES_FILE.format(split=split)))


def drawn_components(mixture: Mixture) -> set[str]:
    """The components some phase draws training sequences from (an evaluation-only one: weight 0
    in every phase, its train split never read)."""
    return {name for _, weights in mixture.phase_weights() for name, weight in weights.items() if weight > 0}


def build_train_dataset(mixture: Mixture, *, seq_len: int, batch_size: int, seed: int, shuffle: bool = True):
    """A Levanter `MixtureDataset` over the components' train splits, phases converted to sequences.

    Only the components drawn in some phase (`drawn_components`) are opened: an evaluation-only
    one may hold no train split. Each component is shuffled with a key folded from the seed and its
    name (a Feistel permutation; adding a component leaves the others' orders alone) before mixing;
    the mixture itself draws exact per-block counts, blocks of `mixture.block_size` sequences, in an order keyed
    by `seed`. Exhausted components restart (Levanter's RESTART strategy).
    """
    schedule = mixture.sequence_schedule(batch_size)
    mix_key, shuffle_key = jax.random.split(jax.random.PRNGKey(seed))
    datasets = {}
    caches = _each_component(mixture, lambda root: load_token_cache(root, "train", seq_len=seq_len),
                             drawn_components(mixture))
    for name, cache in caches.items():
        root = mixture.components[name]
        if len(cache) == 0:
            raise ValueError(f"mixture component {name!r} ({root}) has an empty train split")
        name_key = jax.random.fold_in(shuffle_key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
        datasets[name] = cache.shuffle(name_key) if shuffle else cache
    return MixtureDataset(
        datasets,
        schedule,
        block_size=mixture.block_size,
        key=mix_key,
        stop_strategy=StopStrategy.RESTART_STRATEGY,
    )


def build_validation_datasets(mixture: Mixture, *, seq_len: int) -> dict:
    """{component name: the dataset of its validation split}, for components with a non-empty one."""
    def validation(root: str):
        return load_token_cache(root, "validation", seq_len=seq_len) if has_split(root, "validation") else None

    return {name: cache for name, cache in _each_component(mixture, validation, mixture.components).items()
            if cache is not None and len(cache)}


def _each_component(mixture: Mixture, open_split, names) -> dict:
    """{name: open_split(its cache root)} for the components `names`, in name order, opened on up to
    `OPEN_THREADS` threads: each open is a series of small storage reads (stats, ledger, each
    array's metadata and first rows) that wait outside the interpreter lock, one after the other
    within a cache but not across caches. The twin's 13 components, train and validation, opened in
    0.11 s instead of 0.19 s from a local disk, before its training step can start compiling; from
    object storage each read is a round trip."""
    roots = {name: _root(name, root) for name, root in sorted(mixture.components.items()) if name in names}
    with ThreadPoolExecutor(min(OPEN_THREADS, max(len(roots), 1)), thread_name_prefix="keel-open-cache") as pool:
        return dict(zip(roots, pool.map(open_split, roots.values())))


def _root(name: str, root) -> str:
    if not isinstance(root, str):
        raise TypeError(
            f"mixture component {name!r} is {type(root).__name__}, not a path: pass the mixture as the step "
            "function received it (the executor resolves Steps and Externals to paths)"
        )
    return root
