"""keel.data: documents -> tokenizer -> Levanter token caches -> phased mixtures.

The configs of the steps the planner checks (`TokenizeConfig`, `TrainTokenizerConfig`) and
mixtures (`Mixture`, `MixturePhase`) are declarations in `keel.spec`; the modules that need
tokenizers or Levanter (`tokenizer`, `tokenize`, `datasets`) import them at their top and are
imported here on first use, so declaring a graph stays instant.

Steps (function, config):
    ingest_documents      IngestConfig          local files/globs or a HF dataset -> document set
    build_stdlib_corpus   StdlibCorpusConfig    the running Python's stdlib sources -> document set
    train_tokenizer       TrainTokenizerConfig  document set -> byte-level BPE tokenizer.json
    tokenize_documents    TokenizeConfig        document set + tokenizer -> packed Levanter caches
External: a cache keel does not make.
Training side: build_train_dataset / build_validation_datasets over a resolved Mixture.
Each data step writes `.keel/summary.json` (read_summary): counts, and what was skipped or repaired.
"""

from keel.data.documents import Document, document_texts, EmptyDataError, iter_documents, read_index, split_of
from keel.data.ingest import HfDatasetSpec, IngestConfig, OnBadRecord, OnDecodeError, ingest_documents
from keel.data.quality import BadRecordError
from keel.data.stdlib_corpus import StdlibCorpusConfig, build_stdlib_corpus, stdlib_families
from keel.data.summary import read_summary
from keel.executor.step import External

__all__ = [
    "BadRecordError",
    "Document",
    "EmptyDataError",
    "External",
    "HfDatasetSpec",
    "IngestConfig",
    "OnBadRecord",
    "OnDecodeError",
    "LoadedTokenizer",
    "StdlibCorpusConfig",
    "build_stdlib_corpus",
    "stdlib_families",
    "build_train_dataset",
    "build_validation_datasets",
    "ingest_documents",
    "document_texts",
    "iter_documents",
    "load_token_cache",
    "load_tokenizer",
    "read_index",
    "read_summary",
    "split_of",
    "tokenize_documents",
    "train_tokenizer",
]


# imported on first use: these modules import tokenizers and Levanter, and declaring a graph
# (which imports this package for its light steps) must not
_RUNTIME = {
    "build_train_dataset": "keel.data.datasets",
    "build_validation_datasets": "keel.data.datasets",
    "load_token_cache": "keel.data.datasets",
    "tokenize_documents": "keel.data.tokenize",
    "LoadedTokenizer": "keel.data.tokenizer",
    "load_tokenizer": "keel.data.tokenizer",
    "train_tokenizer": "keel.data.tokenizer",
}


def __getattr__(name: str):
    """The runtime names, imported on first use; a declaration that moved to `keel.spec` says so,
    instead of a bare ImportError."""
    import importlib

    import keel.spec

    if name in _RUNTIME:
        return getattr(importlib.import_module(_RUNTIME[name]), name)
    if name in keel.spec.__all__:
        raise ImportError(f"{__name__}.{name} is a declaration: import it from keel.spec (from keel.spec import {name})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
