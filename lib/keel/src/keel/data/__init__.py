"""keel.data: documents -> tokenizer -> Levanter token caches -> phased mixtures.

Configs here are plain frozen dataclasses; every heavy import (tokenizers, Levanter, jax,
datasets, pyarrow) happens inside the step and build functions, so declaring a graph stays instant.

Steps (function, config):
    ingest_documents      IngestConfig          local files/globs or a HF dataset -> document set
    build_stdlib_corpus   StdlibCorpusConfig    the running Python's stdlib sources -> document set
    train_tokenizer       TrainTokenizerConfig  document set -> byte-level BPE tokenizer.json
    tokenize_documents    TokenizeConfig        document set + tokenizer -> packed Levanter caches
Declarations: Mixture / MixturePhase (phased weights over caches), External (a cache keel does not make).
Training side: build_train_dataset / build_validation_datasets over a resolved Mixture.
Each data step writes `.keel/summary.json` (read_summary): counts, and what was skipped or repaired.
"""

from keel.data.datasets import build_train_dataset, build_validation_datasets, load_token_cache
from keel.data.documents import Document, EmptyDataError, iter_documents, read_index, split_of
from keel.data.ingest import HfDatasetSpec, IngestConfig, ingest_documents
from keel.data.mixture import Mixture, MixtureError, MixturePhase
from keel.data.quality import BadRecordError
from keel.data.stdlib_corpus import StdlibCorpusConfig, build_stdlib_corpus, stdlib_families
from keel.data.summary import read_summary
from keel.data.tokenize import TokenizeConfig, tokenize_documents
from keel.data.tokenizer import LoadedTokenizer, TrainTokenizerConfig, load_tokenizer, train_tokenizer
from keel.executor.step import External

__all__ = [
    "BadRecordError",
    "Document",
    "EmptyDataError",
    "External",
    "HfDatasetSpec",
    "IngestConfig",
    "LoadedTokenizer",
    "Mixture",
    "MixtureError",
    "MixturePhase",
    "StdlibCorpusConfig",
    "TokenizeConfig",
    "TrainTokenizerConfig",
    "build_stdlib_corpus",
    "stdlib_families",
    "build_train_dataset",
    "build_validation_datasets",
    "ingest_documents",
    "iter_documents",
    "load_token_cache",
    "load_tokenizer",
    "read_index",
    "read_summary",
    "split_of",
    "tokenize_documents",
    "train_tokenizer",
]
