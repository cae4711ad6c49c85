"""The sample step: completions of prompts by a checkpoint -> samples.jsonl, printed as well.

Prompts are encoded with the tokenizer (and bos/eos convention) the run's data was tokenized
with. Each new token is one forward pass of keel.model over a fixed [rows, seq_len] window (one
compilation; no KV cache: these are small models), taking the logits at each prompt's last
position. The experts run on the run's dropless transport (`ring` across an expert axis, else
`local`), so a prompt's completion never depends on the other prompts or the padding rows that
fill the batch to the mesh, and each prompt draws from its own generator, seeded by
(seed, prompt index): the same seed gives the same samples, token for token.
Declaring a sample step imports nothing of this module (`defaults.research` names its function
as "keel.trained.sample:sample_step"), so jax is imported by the step's own process alone.
"""

from __future__ import annotations

import hashlib
import json

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from keel.data.tokenizer import load_tokenizer
from keel.executor import storage
from keel.executor.replicas import join_replicas
from keel.mesh.mesh import compute_axis_mapping
from keel.model.axes import BATCH, POS
from keel.spec.resolved import default_transport
from keel.spec.topology import BATCH_AXES
from keel.spec.trained import SampleConfig
from keel.spec.transports import TransportSpec
from keel.train import compile_cache
from keel.train.data_checks import check_prompt_encoding
from keel.trained.load import load_model

SAMPLES_FILE = "samples.jsonl"


def sample_step(config: SampleConfig) -> None:
    """Step function: write one JSON line per prompt ({prompt, completion, token ids, ...}) and print them
    (from the first process of a sample on several: each draws the same tokens)."""
    join_replicas(config.coordinator)  # a sample on several hosts: one jax world (a no-op alone)
    loaded_tokenizer = load_tokenizer(config.tokenizer, bos_token=config.bos_token, eos_token=config.eos_token)
    tokenizer = loaded_tokenizer.tokenizer
    tokenizer.encode_special_tokens = True  # as the tokenize step encoded documents: special strings are text
    check_prompt_encoding("SampleConfig", loaded_tokenizer, config.add_bos, config.model.run)
    if loaded_tokenizer.vocab_size > config.model.model.vocab_size:
        raise ValueError(f"tokenizer {config.tokenizer!r} has {loaded_tokenizer.vocab_size} tokens, more than the model's "
                         f"vocab_size={config.model.model.vocab_size}: sample with the tokenizer the run trained with")
    bos = [loaded_tokenizer.bos_id] if config.add_bos else []
    prompts = [bos + tokenizer.encode(p, add_special_tokens=False).ids for p in config.prompts]
    if not all(prompts):
        raise ValueError("SampleConfig.prompts: an empty prompt without a bos token gives the model nothing to continue")
    compile_cache.use(config.output_path, "sample")
    loaded = load_model(config.model)
    completions = generate(loaded, prompts, context=config.model.train.seq_len, max_tokens=config.max_tokens,
                           temperature=config.temperature, seed=config.seed, stop_id=loaded_tokenizer.eos_id)
    _check_every_process_drew(completions)
    if jax.process_index() != 0:
        return
    lines = []
    for prompt, prompt_ids, ids in zip(config.prompts, prompts, completions):
        text = completion_text(tokenizer, prompt_ids, ids)
        lines.append({"prompt": prompt, "completion": text, "completion_ids": ids, "step": config.model.step,
                      "temperature": config.temperature, "seed": config.seed})
        print(f"--- sample (step {config.model.step}, seed {config.seed}, temperature {config.temperature})\n{prompt}{text}")
    storage.write_atomic(storage.join(config.output_path, SAMPLES_FILE), "".join(json.dumps(r) + "\n" for r in lines))


def _check_every_process_drew(completions: list[list[int]]) -> None:
    """Raise where the processes of a sample on several drew different tokens: each lays out the
    next window from its own copy (`_laid_out` trusts they agree), so a difference would feed the
    model mismatched rows. One gather of a digest per sample, not one per token."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(json.dumps(completions).encode()).digest(), dtype=np.uint8)
    multihost_utils.assert_equal(digest, fail_message="the processes of this sample drew different tokens (their "
                                 "logits differ: a nondeterministic kernel, or processes on other software)")


def completion_text(tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The completion as it reads after its prompt: decoded with the prompt, whose own text is then
    taken off (decoded alone, a SentencePiece-style decoder drops the completion's leading space:
    "The cat" + "sat")."""
    before, whole = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + ids)
    return whole[len(before):] if whole.startswith(before) else tokenizer.decode(ids)


def generate(loaded, prompts: list[list[int]], *, context: int, max_tokens: int, temperature: float, seed: int,
             stop_id: int | None) -> list[list[int]]:
    """Up to `max_tokens` new token ids per prompt, stopping at `stop_id` (not included)."""
    shards = loaded.topology.batch_shards
    rows = -(-len(prompts) // shards) * shards
    sharding = jax.sharding.NamedSharding(loaded.mesh, jax.sharding.PartitionSpec(BATCH_AXES, None))
    by_row = jax.sharding.NamedSharding(loaded.mesh, jax.sharding.PartitionSpec(BATCH_AXES))
    logits_at = _next_token_logits(loaded, jax.sharding.NamedSharding(loaded.mesh, jax.sharding.PartitionSpec()))
    generators = [np.random.default_rng([seed, i]) for i in range(len(prompts))]
    sequences = [list(p) for p in prompts]
    completions: list[list[int]] = [[] for _ in prompts]
    running = set(range(len(prompts)))
    for _ in range(max_tokens):
        if not running:
            break
        ids, segments, last = _window(sequences, rows, context)
        with jax.set_mesh(loaded.mesh):
            logits = logits_at(loaded.arrays, _laid_out(ids, sharding), _laid_out(segments, sharding),
                               _laid_out(last, by_row))
        logits = np.asarray(jax.device_get(logits), dtype=np.float64)
        for i in sorted(running):
            token = _draw(logits[i], temperature, generators[i])
            if token == stop_id:
                running.discard(i)
                continue
            sequences[i].append(token)
            completions[i].append(token)
    return completions


def _laid_out(array: np.ndarray, sharding):
    """`array`, which every process holds whole (each draws the same tokens), as a global array laid
    out by `sharding`, each process placing its own devices' parts. `jax.device_put` would first
    check, across the processes of a run of several, that they all pass the same value: one
    gather per call, three per token."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _window(sequences: list[list[int]], rows: int, context: int):
    """(input_ids, segment_ids, last position) [rows, context]: each sequence's last `context`
    tokens as one document, the rest padding (segment -1); rows past the prompts repeat the first."""
    ids = np.zeros((rows, context), np.int32)
    segments = np.full((rows, context), -1, np.int32)
    last = np.zeros((rows,), np.int32)
    for row in range(rows):
        window = sequences[row if row < len(sequences) else 0][-context:]
        ids[row, :len(window)] = window
        segments[row, :len(window)] = 0
        last[row] = len(window) - 1
    return ids, segments, last


def _draw(logits, temperature: float, generator) -> int:
    """One token id from `logits` (a numpy vector): greedy at temperature 0, else drawn by `generator`."""
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = (logits - logits.max()) / temperature
    p = np.exp(scaled)
    return int(generator.choice(len(p), p=p / p.sum()))


def _next_token_logits(loaded, replicated):
    """Jitted (model arrays, input_ids, segment_ids, last [rows]) -> float32 logits [rows, vocab] at
    each row's last position (picked by a mask and a sum of one term: a gather across the row-split
    batch has no one output layout), replicated on every device: every process of a run of several reads
    them whole (and draws the same tokens), and only these rows leave the devices."""
    static, dtype = loaded.static, loaded.compute_dtype
    transport = TransportSpec(default_transport(loaded.topology).transport)

    def logits(arrays, input_ids, segment_ids, last):
        model = eqx.combine(arrays, static)
        with hax.axis_mapping(compute_axis_mapping()):
            out, _ = model(hax.named(input_ids, (BATCH, POS)), hax.named(segment_ids, (BATCH, POS)),
                           transport=transport, compute_dtype=dtype)
        at_last = jnp.arange(out.array.shape[1])[None, :] == last[:, None]  # [rows, context], split as the rows
        return jnp.where(at_last[:, :, None], out.array.astype(jnp.float32), 0.0).sum(axis=1)  # exact: one term

    return jax.jit(logits, out_shardings=replicated)
