"""The data steps the planner reads: tokenizer training and tokenization, as plain configs.

`keel.spec.data_steps` checks a training step's data against them (vocabulary, sequence length)
before anything runs; the step functions that execute them are `keel.data.tokenizer.train_tokenizer`
and `keel.data.tokenize.tokenize_documents`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from keel.executor import storage
from keel.executor.step import OutputOf, Step, execution_only, this_output

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def tokenizer_files(ref: str) -> tuple[str, str]:
    """(tokenizer.json, tokenizer_config.json) of a tokenizer directory or a tokenizer.json path."""
    if ref.endswith(".json"):
        scheme, sep, path = ref.rpartition("://")  # a store's root keeps its `scheme://`: memory://tok.json
        folder = f"{scheme}{sep}{path.rsplit('/', 1)[0] if '/' in path else ('' if sep else '.')}"
        return ref, storage.join(folder, TOKENIZER_CONFIG_FILE)
    return storage.join(ref, TOKENIZER_FILE), storage.join(ref, TOKENIZER_CONFIG_FILE)


def tokenizer_input_files(ref) -> dict[str, str]:
    """The files of a tokenizer given by path, for a step's identity (`ReadsFiles.input_files`):
    a tokenizer.json rewritten in place then makes the step stale instead of serving what the old
    vocabulary made. A tokenizer a step made (`output_of`) counts through that step; a hub name
    has no files here. Each file is named as declared, so the identity does not depend on the machine."""
    if not isinstance(ref, str):
        return {}
    return {path: path for path in tokenizer_files(ref) if storage.exists(path)}


DOCUMENTS, TOKENIZER, TOKEN_CACHE = "a document set", "a tokenizer", "a token cache"
"""What a data step makes (its config class's `makes`), checked where another step reads it."""


def check_made(field_name: str, value, wanted: str) -> None:
    """Refuse a keel data step's output where another kind of output is read (`default_tokenize`'s
    documents and tokenizer swapped, the documents step given as training data), naming the field;
    a path, an External or a step of the user's own is the reader's to check."""
    step = value.step if isinstance(value, OutputOf) else value
    made = getattr(type(getattr(step, "config", None)), "makes", None) if isinstance(step, Step) else None
    if made is not None and made != wanted:
        raise ValueError(f"{field_name} is the step {step.name!r}, which makes {made}, not {wanted}: give "
                         + {DOCUMENTS: "a documents step (an ingest or corpus step)", TOKENIZER: "a tokenizer step, "
                            "a tokenizer path or a hub name", TOKEN_CACHE: "a tokenize step made from it "
                            "(`default_tokenize`), or an External token cache"}[wanted])


@dataclass(frozen=True)
class TrainTokenizerConfig:
    """Train a byte-level BPE on the train split of the document set at `documents`."""

    makes: ClassVar[str] = TOKENIZER
    documents: str
    vocab_size: int = 1024
    bos_token: str | None = "<|bos|>"
    eos_token: str = "<|endoftext|>"
    pad_token: str | None = "<|pad|>"
    min_frequency: int = 2
    max_training_bytes: int | None = None
    output_path: str = this_output()

    def __post_init__(self):
        check_made("TrainTokenizerConfig.documents", self.documents, DOCUMENTS)
        if self.min_frequency < 0:
            raise ValueError(f"TrainTokenizerConfig.min_frequency={self.min_frequency} must be >= 0")
        if self.max_training_bytes is not None and self.max_training_bytes <= 0:
            raise ValueError(f"TrainTokenizerConfig.max_training_bytes={self.max_training_bytes} must be positive "
                             "(None: every document of the train split)")
        specials = self.special_tokens
        if len(set(specials)) != len(specials):
            raise ValueError(f"TrainTokenizerConfig: bos/eos/pad tokens must differ, got {specials}")
        if self.vocab_size < 256 + len(specials):
            raise ValueError(
                f"TrainTokenizerConfig.vocab_size={self.vocab_size} is too small: a byte-level BPE needs "
                f"256 byte tokens plus {len(specials)} special tokens"
            )

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tuple(t for t in (self.eos_token, self.bos_token, self.pad_token) if t is not None)


@dataclass(frozen=True)
class TokenizeConfig:
    """Tokenize the document set at `documents` with `tokenizer` (a tokenizer directory,
    a tokenizer.json path or a hub name) into `seq_len`-token packed sequences.

    `bos_token`/`eos_token` name the special tokens for a tokenizer that does not carry a
    tokenizer_config.json; each document gets bos/eos added as `add_bos`/`add_eos` say. A
    tokenizer given by path counts toward the step's identity by its files' contents.
    """

    makes: ClassVar[str] = TOKEN_CACHE
    documents: str
    tokenizer: str
    seq_len: int = 1024
    add_bos: bool = False
    add_eos: bool = True
    bos_token: str | None = None
    eos_token: str | None = None
    output_path: str = this_output()
    batch_documents: int = execution_only(default=64)

    def __post_init__(self):
        if self.seq_len <= 0:
            raise ValueError(f"TokenizeConfig.seq_len must be positive, got {self.seq_len}")
        check_made("TokenizeConfig.documents", self.documents, DOCUMENTS)
        check_made("TokenizeConfig.tokenizer", self.tokenizer, TOKENIZER)
        if self.batch_documents <= 0:
            raise ValueError(f"TokenizeConfig.batch_documents must be positive, got {self.batch_documents}")

    def input_files(self) -> dict[str, str]:
        return tokenizer_input_files(self.tokenizer)
