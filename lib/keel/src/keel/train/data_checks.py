"""Before a training step compiles: do its token caches fit the model and the run declared?

A token cache keel made says, in its `tokenize.json`, the sequence length it was packed at, the
vocabulary of the tokenizer that made its ids, and how many sequences each split holds. Each is
checked against the training step here, in the step's process, before any compute:

- ids from a tokenizer larger than `MoELMConfig.vocab_size` would be clamped by the embedding
  gather, training a silently wrong model;
- sequences packed at another length than `TrainConfig.seq_len` cannot be batched;
- caches whose ids come from different tokenizers (or add bos/eos differently) mean different
  text by one id: a mixture of them trains on noise with a plausible loss;
- a declared evaluation (`TrainConfig.eval_batches > 0`) with no validation sequences in any
  cache would silently never run;
- an evaluation on documents that another component trains on would report memorisation as
  generalisation. Documents are held out by their id's hash (`keel.data.documents.split_of`), so
  two document sets of the same files at different validation fractions do this, and so do two
  sets holding one text under other ids; each cache's `tokenize.json` names its document set,
  whose splits list their documents' text hashes. The run records the sets it trains on
  (`data.json`), and an eval step of its checkpoints is held to the same rule.

Where the producing steps' configs already say it, `keel plan` refuses the same mistakes first
(`keel.spec.checks`). Of caches keel did not make (no `tokenize.json`), whether they hold a
validation split is checked here; the rest is left to Levanter's checks.
"""

from __future__ import annotations

import jax
import numpy as np

from keel.data.cache_files import STATS_FILE, has_split
from keel.data.datasets import drawn_components
from keel.data.documents import document_texts, text_hash
from keel.data.tokenizer import LoadedTokenizer
from keel.executor import storage, warn
from keel.spec.mixture import Mixture
from keel.spec.train import TrainStepConfig


def cache_components(data: Mixture) -> dict[str, str]:
    """{component name: cache root} of a resolved mixture; only paths."""
    return {name: root for name, root in data.components.items() if isinstance(root, str)}


def check_cache_vocab(where: str, stats: dict, vocab_size: int) -> None:
    """Raise a ValueError where a token cache (its tokenize.json `stats`) holds ids the model has no
    embedding for: the lookup clamps them into the last row, and the loss looks plausible."""
    if stats["vocab_size"] > vocab_size:
        raise ValueError(
            f"the tokenizer of {where} makes ids up to {stats['vocab_size'] - 1:,} but MoELMConfig.vocab_size="
            f"{vocab_size:,}: ids >= {vocab_size:,} would be clamped into wrong embeddings; set "
            f"MoELMConfig.vocab_size >= {stats['vocab_size']:,}, or train the tokenizer with "
            f"TrainTokenizerConfig.vocab_size <= {vocab_size:,}"
        )


def check_token_caches(config: TrainStepConfig) -> dict | None:
    """Raise a ValueError naming both fields and the fix for a cache that does not fit the run; the
    caches' shared tokenizer identity (`check_one_tokenizer`)."""
    model, train = config.model, config.train
    stats = cache_stats(config.data)
    for name, (root, found) in stats.items():
        where = f"token cache {name!r} ({root})"
        if found["seq_len"] != train.seq_len:
            raise ValueError(
                f"TrainConfig.seq_len={train.seq_len} differs from TokenizeConfig.seq_len={found['seq_len']} of {where}: "
                f"set TrainConfig.seq_len={found['seq_len']}, or tokenize again with TokenizeConfig.seq_len={train.seq_len}"
            )
        check_cache_vocab(where, found, model.vocab_size)
    identity = check_one_tokenizer(stats)
    _warn_of_repeats(config, stats)
    roots = cache_components(config.data)
    if train.eval_batches > 0 and roots and not any(
            _validation_sequences(stats[name][1]) if name in stats else has_split(root, "validation")
            for name, root in roots.items()):
        detail = ", ".join(f"{name!r} has " + (_describe_validation(stats[name][1]) if name in stats else
                                               "no validation split") for name in roots)
        fix = ("raise the documents step's validation_fraction (or give it more documents)" if stats else
               "build the cache with a validation split")
        raise ValueError(
            f"TrainConfig.eval_batches={train.eval_batches} declares an evaluation, but no token cache has validation "
            f"sequences ({detail}): {fix}, or set TrainConfig.eval_batches=0 to train without evaluation"
        )
    if train.eval_batches > 0:
        check_held_out_documents(stats, trained=drawn_components(config.data))
    return identity


RUN_DATA_FILE = "data.json"
"""A training step's record of its caches' tokenizer and of the document sets it trains on, under its
output (`record_run_data`), which its evaluations hold their caches to."""


def cache_stats(data: Mixture) -> dict[str, tuple[str, dict]]:
    """{component: (cache root, its tokenize.json)} of the caches keel made (the others say nothing)."""
    stats = {}
    for name, root in cache_components(data).items():
        found = storage.read_json(storage.join(root, STATS_FILE))
        if found is not None:
            stats[name] = (root, found)
    return stats


def record_run_data(output_path: str, identity: dict | None, data: Mixture) -> None:
    """Write what the run's ids mean (its caches' shared tokenizer identity, `check_token_caches`;
    None where no cache says) and the document sets its drawn components were tokenized from to its
    output's `data.json`, for its checkpoints' evaluations to check against."""
    stats = cache_stats(data)
    trained = sorted({stats[name][1]["documents"] for name in drawn_components(data)
                      if name in stats and stats[name][1].get("documents")})
    storage.write_json(storage.join(output_path, RUN_DATA_FILE), {"tokenizer": identity, "trained_documents": trained})


def check_evaluated_documents_held_out(caches: dict[str, tuple[str, dict]], run_output: str) -> None:
    """Refuse an evaluation of run `run_output` on validation documents it trained on (above
    `SHARED_VALIDATION_REFUSED_ABOVE` of a cache's validation text; warn of less), as the run's own
    evaluation is held to (`check_held_out_documents`). `caches` is {label: (root, its
    tokenize.json)}; the run's document sets come from its `data.json`."""
    recorded = storage.read_json(storage.join(run_output, RUN_DATA_FILE)) or {}
    if "trained_documents" not in recorded:
        if jax.process_index() == 0:
            print(f"[data] run {run_output} trained before keel recorded its document sets: whether the evaluated "
                  "documents are among its training documents is not checked")
        return
    labels: dict[str, list[str]] = {}
    for label, (root, found) in caches.items():
        if found.get("documents"):
            labels.setdefault(found["documents"], []).append(f"EvalConfig.data[{label!r}]")
    check_held_out({path: f"{' and '.join(names)} (document set {path})" for path, names in labels.items()},
                   {path: f"run {run_output} ({path})" for path in recorded["trained_documents"]})


def _described(identity: dict) -> str:
    return f"vocabulary {identity['vocabulary']}, bos id {identity['bos_id']}, eos id {identity['eos_id']}"


def check_same_tokenizer_as_run(where: str, stats: dict, run_output: str) -> None:
    """Raise a ValueError where a cache (its tokenize.json `stats`) gives ids other meanings than the
    run trained on (its `data.json`); nothing to compare where either does not say."""
    recorded = storage.read_json(storage.join(run_output, RUN_DATA_FILE)) or {}
    mine, theirs = stats.get("tokenizer"), recorded.get("tokenizer")
    if mine and theirs and mine != theirs:
        raise ValueError(f"{where} was tokenized differently from the training data of run {run_output} "
                         f"({_described(mine)} against {_described(theirs)}): its ids mean other text than the model "
                         "learned; evaluate on caches made with the run's tokenizer")


def check_prompt_encoding(where: str, loaded: LoadedTokenizer, add_bos: bool, run_output: str) -> None:
    """Raise a ValueError where prompts encoded with `loaded`, a bos id first as `add_bos` says, would
    not read as the run's documents did (its `data.json`): another vocabulary, or another id at a
    document's start. A sample step declared before a `--set` on the run's tokenize step kept the
    old convention and sampled from prompts the model never saw the like of."""
    recorded = (storage.read_json(storage.join(run_output, RUN_DATA_FILE)) or {}).get("tokenizer")
    if not recorded:
        return
    if loaded.vocabulary != recorded["vocabulary"]:
        raise ValueError(f"{where}: its tokenizer's vocabulary {loaded.vocabulary} is not the one run {run_output} "
                         f"trained on ({recorded['vocabulary']}): its ids mean other text than the model learned; "
                         "sample with the run's tokenizer (default_sample finds it through the run's tokenize steps)")
    bos = loaded.bos_id if add_bos else None
    if bos != recorded["bos_id"]:
        theirs = "no bos id" if recorded["bos_id"] is None else f"bos id {recorded['bos_id']}"
        fix = "add_bos=False" if recorded["bos_id"] is None else f"add_bos=True with the bos token of id {recorded['bos_id']}"
        raise ValueError(f"{where}: prompts would start with {'no bos id' if bos is None else f'bos id {bos}'}, while "
                         f"the documents of run {run_output} started with {theirs}: set {fix}, as the run's "
                         "tokenize step has it (default_sample finds it there unless given tokenizer=, whose "
                         "add_bos= and bos_token= say it then)")


def check_one_tokenizer(stats: dict[str, tuple[str, dict]]) -> dict | None:
    """Raise a ValueError where the caches (`stats`: {component: (root, its tokenize.json)}) give
    ids different meanings: another vocabulary, or other bos/eos ids added; else their one identity
    (None where none says). A cache that does not say (made before keel recorded it, or by another
    tool) is not compared."""
    identities = {name: found["tokenizer"] for name, (_, found) in stats.items() if found.get("tokenizer")}
    if len({tuple(sorted(i.items())) for i in identities.values()}) > 1:
        described = "; ".join(f"{name!r} ({stats[name][0]}): {_described(i)}" for name, i in identities.items())
        raise ValueError(f"the run's token caches were tokenized differently ({described}), so one id means different "
                         "text in each: tokenize every component with one tokenizer and the same add_bos/add_eos "
                         "and special tokens")
    return next(iter(identities.values()), None)


def _warn_of_repeats(config: TrainStepConfig, stats: dict[str, tuple[str, dict]]) -> None:
    """A run that draws more sequences from a cache than its train split holds reads the same data
    again (Levanter's datasets wrap around) with no word said: warn, with the passes it makes (once
    per run, from its first process, not once per replica)."""
    if jax.process_index() != 0:
        return
    drawn = config.data.sequences_drawn(config.train.batch_size, config.train.num_steps)
    for name, (root, found) in stats.items():
        held = found["splits"].get("train", {}).get("sequences", 0)
        if held and drawn.get(name, 0) > held:
            message = (f"token cache {name!r} ({root}) holds {held:,} training sequences and the run draws about "
                       f"{drawn[name]:,} from it: {drawn[name] / held:.1f} passes over the same data; give it more "
                       "documents, or train fewer steps or a smaller batch")
            print(f"[data] warning: {message}")
            warn(message)


SHARED_VALIDATION_REFUSED_ABOVE = 0.01
"""The share of a component's validation text (in bytes, as the loss averages over tokens) that
may be training text of the mixture's other components before the run is refused; a smaller share
(a boilerplate page two web sources both hold) moves its validation loss by about that share, so
the run goes on with a warning."""


BLANK = text_hash("")
"""What every whitespace-only text hashes to: two corpora that each hold a blank record share nothing."""


def check_held_out_documents(stats: dict[str, tuple[str, dict]], trained: set[str]) -> None:
    """Refuse a run where more than `SHARED_VALIDATION_REFUSED_ABOVE` of a component's validation
    text is training text of the components in `trained` (those drawn in some phase; an
    evaluation-only one trains on nothing); warn of less. `stats` is {component: (cache root, its
    tokenize.json)}."""
    sets = {name: found["documents"] for name, (_, found) in stats.items() if found.get("documents")}
    check_held_out({path: f"token cache {_named(sets, path)} ({path})" for path in sets.values()},
                   {sets[name]: f"{_named(sets, sets[name])} ({sets[name]})" for name in trained if name in sets})


def check_held_out(held: dict[str, str], trainers: dict[str, str]) -> None:
    """Refuse where more than `SHARED_VALIDATION_REFUSED_ABOVE` of the validation text of a document
    set in `held` is training text of another set in `trainers` (each {document set: how the
    message names it}); warn of less. A set's own splits never share a text. Texts are compared
    whitespace-collapsed (`keel.data.documents.text_hash`), so the same record in two files counts
    and two files' records that share only their ids (`data.jsonl:7` of two folders) do not; blank
    texts are left out."""
    if not any(path != other for path in held for other in trainers):
        return  # one document set splits each text one way
    paths = sorted(held)
    held_out = {path: document_texts(path, "validation") for path in paths}  # the small splits, all at once
    shared = {path: np.zeros(len(texts[0]), dtype=bool) for path, texts in held_out.items() if texts is not None}
    by = {path: [] for path in shared}  # the document sets that train on some of a set's validation texts
    unchecked = [path for path in paths if held_out[path] is None]
    for other_path in sorted(trainers):  # the training splits one at a time: memory for the largest, not for all
        if other_path in unchecked or not any(path != other_path for path in shared):
            continue
        texts = document_texts(other_path, "train")
        if texts is None:
            unchecked.append(other_path)
            continue
        for path in shared:
            if path != other_path:
                found = np.isin(held_out[path][0], texts[0]) & (held_out[path][0] != BLANK)
                shared[path] |= found
                if found.any():
                    by[path].append(other_path)
    primary = jax.process_index() == 0  # one message per run, not one per replica
    for path in unchecked if primary else ():
        print(f"[data] document set {path} was written before keel recorded its texts' hashes: whether its documents "
              "are held out in one set and trained on in another is not checked (rerun its ingestion step "
              "with keel run --force NAME to check it)")
    for path, found in shared.items():
        if found.any():
            _shared_texts(found, held_out[path][1], held[path], " and ".join(trainers[p] for p in by[path]), primary)


def _named(sets: dict[str, str], path: str) -> str:
    """The components that read one document set: 'a', or 'a' and 'b'."""
    return " and ".join(repr(name) for name, p in sets.items() if p == path)


def _shared_texts(found, sizes, held: str, trainers: str, primary: bool) -> None:
    """Refuse a validation split whose `found` documents (of `sizes` bytes each) hold more than the
    allowed share of its text; warn of less."""
    share = float(sizes[found].sum()) / max(float(sizes.sum()), 1.0)
    what = (f"{int(found.sum())} of the {len(found)} validation documents of {held}, {share:.1%} of its validation "
            f"text, are training documents of {trainers}")
    if share > SHARED_VALIDATION_REFUSED_ABOVE:
        raise ValueError(
            f"{what}: its validation loss would measure memorisation. A document is held out by its id's hash: where "
            "both sets read the same files, give them one validation_fraction (each document then falls in the same "
            "split in both); else remove the shared texts from one set's inputs"
        )
    message = (f"{what} (at most {SHARED_VALIDATION_REFUSED_ABOVE:.0%} is allowed): its validation loss counts them as "
               "unseen; remove the shared texts from one set's inputs to measure it exactly")
    if primary:
        print(f"[data] warning: {message}")
        warn(message)


def _validation_sequences(stats: dict) -> int:
    return stats["splits"].get("validation", {}).get("sequences", 0)


def _describe_validation(stats: dict) -> str:
    split = stats["splits"].get("validation", {})
    return f"{split.get('sequences', 0)} validation sequences from {split.get('documents', 0)} documents"
