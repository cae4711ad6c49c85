"""A training step against the data steps that feed it, as declared: caught by `keel plan`.

When the training data is a tokenize step (or a mixture of them), its config already says the
sequence length the cache will be packed at, its tokenizer step's config the vocabulary size, and
its documents step's config whether there will be a validation split at all. A mismatch with the
model or the run is then a declaration error, found before anything runs. What only the caches
themselves can tell (a tokenizer given by path, an External cache) is checked by the training
step before it compiles (`keel.train.data_checks`).
"""

from __future__ import annotations

from typing import Any

from keel.spec.data import TokenizeConfig, TrainTokenizerConfig
from keel.executor.step import OutputOf, Step
from keel.spec.train import TrainStepConfig


def _producer(value: Any) -> Step | None:
    """The step behind a config value (a Step or output_of one), else None."""
    if isinstance(value, OutputOf):
        value = value.step
    return value if isinstance(value, Step) else None


def data_step_problem(config: TrainStepConfig) -> str | None:
    """The first mismatch between the training step and its declared data steps, as a message
    naming both fields and the fix; None when they agree (or the data steps are not declared here)."""
    model, train = config.model, config.train
    tokenizes = []
    vocabularies = {}  # component -> what its ids mean: the tokenizer and the specials added
    for name, value in config.data.components.items():
        step = _producer(value)
        tokenizes.append(step if step is not None and isinstance(step.config, TokenizeConfig) else None)
        if tokenizes[-1] is None:
            continue
        cache = step.config
        if cache.seq_len != train.seq_len:
            return (f"train.seq_len={train.seq_len} differs from TokenizeConfig.seq_len={cache.seq_len} of data step "
                    f"{step.name!r}: set train.seq_len={cache.seq_len}, or tokenize with seq_len={train.seq_len}")
        tokenizer = _producer(cache.tokenizer)
        vocabularies[name] = (tokenizer.name if tokenizer is not None else str(cache.tokenizer), cache.add_bos,
                              cache.add_eos, cache.bos_token, cache.eos_token)
        if tokenizer is not None and isinstance(tokenizer.config, TrainTokenizerConfig):
            if cache.add_bos and tokenizer.config.bos_token is None and cache.bos_token is None:
                return (f"TokenizeConfig.add_bos=True of data step {step.name!r}, but its tokenizer step "
                        f"{tokenizer.name!r} has bos_token=None: give the tokenizer a bos_token, or set add_bos=False")
            vocab = tokenizer.config.vocab_size
            if vocab > model.vocab_size:
                return (f"model.vocab_size={model.vocab_size} is smaller than TrainTokenizerConfig.vocab_size={vocab} of "
                        f"tokenizer step {tokenizer.name!r} (data step {step.name!r} tokenizes with it): ids >= "
                        f"{model.vocab_size} would be clamped into wrong embeddings; set model.vocab_size >= {vocab}, "
                        f"or train the tokenizer with vocab_size <= {model.vocab_size}")
    if len(set(vocabularies.values())) > 1:
        described = "; ".join(f"{name!r}: {tok}, add_bos={bos}, add_eos={eos}"
                              + (f", bos_token={b!r}" if b else "") + (f", eos_token={e!r}" if e else "")
                              for name, (tok, bos, eos, b, e) in vocabularies.items())
        return (f"data: the mixture's components were tokenized differently ({described}), so one id means "
                "different text in each: tokenize every component with one tokenizer and the same add_bos/add_eos "
                "and special tokens")
    if train.eval_batches > 0 and tokenizes and all(s is not None for s in tokenizes):
        fractions = {s.name: getattr(getattr(_producer(s.config.documents), "config", None), "validation_fraction", None)
                     for s in tokenizes}
        if all(f == 0 for f in fractions.values()):
            return (f"train.eval_batches={train.eval_batches} declares an evaluation, but the documents behind "
                    f"{', '.join(repr(n) for n in fractions)} have validation_fraction=0: no validation split; give "
                    "the documents step a validation_fraction > 0, or set train.eval_batches=0")
    return None
