"""The files of a keel token cache, named once for the step that writes them (`keel.data.tokenize`),
the datasets that read them (`keel.data.datasets`) and the training step's pre-flight checks
(`keel.train.data_checks`), none of which should import another's dependencies to know a name."""

from keel.executor import storage

STATS_FILE = "tokenize.json"
"""Counts per split, the packed sequence length and the tokenizer's vocabulary; written last."""

BYTES_FILE = "{split}.bytes.npy"
"""int64[sequences]: the UTF-8 bytes of the tokens the loss predicts in each sequence (`SequenceBytes`)."""

LEDGER_FILE = "shard_ledger.json"
"""Levanter's `levanter.store.cache.LEDGER_FILE_NAME`, in each split's folder: written when the split's
cache is complete. Spelled here so the readers need not import that module (a test pins the two)."""


def has_split(cache_root: str, split: str) -> bool:
    """Whether the cache holds a finished `split` (its ledger is there), keel's or another's."""
    return storage.exists(storage.join(cache_root, split, LEDGER_FILE))


CONSOLIDATED = "consolidated"
"""Levanter's `CACHE_LAYOUT_CONSOLIDATED`: the ledger's layout of a cache that is one store, as
Levanter's `SerialCacheWriter` writes keel's."""
