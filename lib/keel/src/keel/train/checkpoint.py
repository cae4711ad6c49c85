"""Training-state checkpoints under a step's output path, with Levanter's tensorstore checkpointer.

Two kinds, as in Levanter: rolling (temporary) checkpoints, every N steps and/or by wall-clock
time, of which the newest `keep_rolling` are kept, and permanent ones where the run's
`TrainConfig.keeps_checkpoint` says (every N steps, the final step, each transport switch), never
deleted; a permanent checkpoint supersedes the rolling ones, which are then removed. A rerun of a
step that died finds the newest complete checkpoint and resumes from it; Levanter only writes a
checkpoint's `metadata.json` once every array is committed, so a checkpoint torn by `kill -9` is
never picked. A checkpoint damaged
after it was written (a truncated array file: tensorstore's OUT_OF_RANGE) is skipped with a line
saying which and why, and the newest intact one before it restored (in a run of several
processes, which each read their own shards, by all of them when any finds it damaged:
`_worst_of_every_process`, which says where that cannot hold); with none intact the run starts
from its initial state. A skipped checkpoint is moved aside, whole, to `checkpoints-damaged/`
beside `checkpoints/` (kept to be looked at, never deleted): left in place it would still count as
the newest rolling checkpoint, and Levanter, keeping the newest N, would delete each new one as
soon as it was written; and the run, back at its step, would write into it.

States are restored into the shardings of an exemplar (the state's shapes with the resolved run's
shardings: the loop's resume and `keel.trained.load` compute no array to overwrite), so a
restored run keeps its expert sharding whatever the model's named-axis mapping is, and each
array's memory kind (device or pinned host, `keel.train.offload`): the format has no layout in it.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import urllib.parse
from collections.abc import Callable

import fsspec
import haliax as hax
import jax
import numpy as np
from jax.experimental import multihost_utils
from levanter.checkpoint import (
    Checkpointer,
    CheckpointRetention,
    discover_latest_checkpoint,
    load_checkpoint,
)
from levanter.tensorstore_serialization import ReplicaRestoreMode, TensorStoreReadConfig

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
DAMAGED_DIR = "checkpoints-damaged"
TENSORSTORE_SCHEMES = ("", "file", "gs", "s3")
"""The stores Levanter's checkpoints reach (`levanter.tensorstore_serialization.build_kvstore_spec`)."""


def checkpoint_root(output_path: str) -> str:
    return os.path.join(output_path, CHECKPOINTS_DIR)


def check_store(output_path: str) -> None:
    """Refuse, before anything compiles, a run whose checkpoints could not be saved: it would fail
    at its first save."""
    scheme = urllib.parse.urlparse(output_path).scheme
    if scheme not in TENSORSTORE_SCHEMES:
        raise ValueError(f"a training step cannot run under {scheme}:// ({output_path}): Levanter writes its "
                         "checkpoints with tensorstore, which takes a local path, gs:// or s3://; give the run "
                         "such a prefix (`keel run --prefix`)")


_READ, _DAMAGED, _FAILED = 0, 1, 2  # one process's read of a checkpoint, worst last


def _worst_of_every_process(outcome: int) -> int:
    """The worst read outcome among the run's processes. Each reads only its own shards, so one may
    find a checkpoint damaged that another read whole: they fall back together, or fail together,
    instead of training on from different steps. This holds where the restore itself runs no
    collective (`_read_config`: every replica reads, as on CPUs); on accelerators one replica reads
    each shard and an all-reduce hands it on, and a process that fails mid-read leaves the others
    in that all-reduce: the run then stops at the coordinator's timeout, and the damaged checkpoint
    must be moved aside by hand (to `checkpoints-damaged/`)."""
    if jax.process_count() == 1:
        return outcome
    return int(np.max(multihost_utils.process_allgather(np.asarray(outcome, dtype=np.int32))))


class TrainCheckpoints:
    """Saves the train state by Levanter's time/step policies and restores the newest one."""

    def __init__(self, output_path: str, *, permanent: Callable[[int], bool], rolling_every: int | None = None,
                 rolling_minutes: float | None = None, keep_rolling: int = 1):
        """`permanent(step)`: whether the checkpoint of `step` completed steps is kept for good (the
        run's `TrainConfig.keeps_checkpoint`, which eval and sample steps are held to)."""
        self.root = checkpoint_root(output_path)
        self.permanent = permanent
        self.rolling_every = rolling_every
        interval = datetime.timedelta(minutes=rolling_minutes) if rolling_minutes else None
        self._checkpointer = _checkpointer_class()(self.root, interval, [], keep_last_temporary_checkpoints=keep_rolling)

    def latest(self) -> str | None:
        return discover_latest_checkpoint(self.root)

    def latest_step(self) -> int | None:
        """The completed steps of the newest checkpoint, None when there is none."""
        latest = self.latest()
        return self.step_of(latest) if latest is not None else None

    def restore(self, exemplar, path: str):
        """The state saved at `path`, laid out like `exemplar` (arrays or ShapeDtypeStructs: the same
        tree, shardings, memory kinds and dtypes); when `path` is damaged (`_damaged`), the newest
        older checkpoint that reads, else None. Any other error stops the run."""
        skipped: list[str] = []
        candidate: str | None = path
        while candidate is not None:
            state, error, outcome = None, None, _READ
            try:
                state = restore_like(exemplar, candidate)
            except Exception as exc:
                error, outcome = exc, _DAMAGED if _damaged(exc) else _FAILED
            worst = _worst_of_every_process(outcome)  # each process reads its own shards: they must agree
            if worst != _READ:
                where = "" if outcome == worst else " on another of the run's processes"
                why = (f"{type(error).__name__}: {(str(error).strip().splitlines() or [type(error).__name__])[0][:300]}"
                       if outcome == worst else "that process says why")  # its own error, or another process's
                if worst == _FAILED:  # a storage outage, a permission, memory: skipping would throw away the run
                    raise RuntimeError(f"checkpoint {candidate} could not be read{where} ({why}), and not because it is "
                                       "damaged: the run stops rather than train again from an older checkpoint or "
                                       "from step 0; fix the cause and rerun the step") from error
                print(f"[train] skipping checkpoint {candidate}: it cannot be read{where} ({why})", flush=True)
                skipped.append(candidate)
                candidate = discover_latest_checkpoint(self.root, exclude_paths=skipped)
                continue
            if skipped:
                print(f"[train] restored {candidate} instead (the newest checkpoint that reads)", flush=True)
                self._set_aside(skipped)
            return state
        print(f"[train] no checkpoint under {self.root} can be read: starting from the initial state", flush=True)
        self._set_aside(skipped)
        return None

    def _set_aside(self, damaged: list[str]) -> None:
        """Move each damaged checkpoint to `checkpoints-damaged/` and out of the checkpointer's
        rolling ones (it found them when it was made)."""
        if jax.process_index() == 0 and damaged:
            aside = os.path.join(os.path.dirname(self.root.rstrip("/")), DAMAGED_DIR)
            fs, _ = fsspec.core.url_to_fs(aside)
            fs.makedirs(aside, exist_ok=True)
            for path in damaged:
                name = os.path.basename(path.rstrip("/"))
                target, copy = os.path.join(aside, name), 1
                while fs.exists(target):  # damaged at the same step before: keep both
                    target, copy = os.path.join(aside, f"{name}.{copy}"), copy + 1
                fs.mv(path, target, recursive=True)
                print(f"[train] moved the damaged checkpoint {path} to {target} (delete it once looked at)", flush=True)
        self._checkpointer.forget(damaged)

    @staticmethod
    def step_of(path: str) -> int:
        """The completed steps of the checkpoint at `path` (from its metadata)."""
        with fsspec.open(os.path.join(path, "metadata.json")) as f:
            return int(json.load(f)["step"])

    def on_step(self, state, step: int, *, rolling: bool = False) -> bool:
        """Save a permanent checkpoint where `permanent` says so, else a rolling one by the time or
        step cadence, at least a rolling one if `rolling`; `step` counts completed optimizer steps.
        True when a save of this step started."""
        if rolling or (self.rolling_every and step % self.rolling_every == 0):
            self._checkpointer.request_checkpoint(CheckpointRetention.TEMPORARY)
        self._checkpointer.saving_step = None
        self._checkpointer.on_step(tree=state, step=step, force=self.permanent(step))
        return self._checkpointer.saving_step == step

    def wait(self) -> None:
        self._checkpointer.wait_until_finished()


DAMAGE = ("OUT_OF_RANGE", "NOT_FOUND", "DATA_LOSS")
"""Tensorstore's status codes for a checkpoint's own damage: a truncated data file (a full disk, a
killed copy), a missing one, an undecodable manifest."""


def _damaged(exc: Exception) -> bool:
    """Whether a restore failed on the checkpoint's own damage, which the next older checkpoint
    survives, rather than on its storage (UNAVAILABLE, PERMISSION_DENIED) or this host."""
    if isinstance(exc, (FileNotFoundError, json.JSONDecodeError)):  # a missing or torn metadata file
        return True
    return isinstance(exc, ValueError) and str(exc).startswith(DAMAGE)


@functools.cache
def _checkpointer_class():
    """Levanter's `Checkpointer`, noting the step of each save it starts (`saving_step`): its
    `on_step` decides by its policies, returns nothing and keeps the step it saved private, so the
    public `save_checkpoint` that `on_step` calls for every save is where keel sees it; and
    forgetting the damaged checkpoints keel sets aside (`forget`)."""
    class SaveNotingCheckpointer(Checkpointer):
        saving_step: int | None = None

        def save_checkpoint(self, tree, step, destination, commit_callback=None, **kwargs):
            super().save_checkpoint(tree, step, destination, commit_callback, **kwargs)
            self.saving_step = step

        def forget(self, paths: list[str]) -> None:
            """Drop these checkpoints from the rolling ones found at start (Levanter keeps the newest
            N of that list, so a damaged one counted there would outlive every new save)."""
            gone = {path.rstrip("/") for path in paths}
            self._temporary_checkpoints = [r for r in self._temporary_checkpoints if r.path.rstrip("/") not in gone]

    return SaveNotingCheckpointer


def _not_a_none_leaf(record: logging.LogRecord) -> bool:
    """Levanter warns "Unknown leaf type <class 'NoneType'>" for each None in the tree (an absent
    optional part holds nothing to load); five such lines per load made users doubt it loaded."""
    return not record.getMessage().startswith("Unknown leaf type <class 'NoneType'>")


def _read_config() -> TensorStoreReadConfig:
    """How replicated arrays are read back. On accelerators one replica reads each shard from
    storage and an all-reduce hands it to the others (Levanter's default: less storage traffic).
    Simulated CPU devices share one host's memory and page cache, so there every replica reads its
    own copy: the all-reduce costs a compile per distinct leaf (25 programs, 1.5 s of tiny_moe's
    first resume) and saves nothing."""
    if jax.default_backend() == "cpu":
        return TensorStoreReadConfig(replica_mode=ReplicaRestoreMode.EVERY_REPLICA)
    return TensorStoreReadConfig()


def restore_like(exemplar, path: str, subpath: str | None = None):
    """Load a checkpoint (its `subpath` subtree, e.g. "model", when given) into the exact tree,
    shardings and dtypes of `exemplar`.

    Named arrays are read as their raw arrays (same checkpoint keys), so each leaf is placed by its
    exemplar's concrete sharding rather than by an axis mapping (which Levanter's `load_checkpoint`
    uses for a named array).
    """
    serialization_log = logging.getLogger("levanter.tensorstore_serialization")
    if _not_a_none_leaf not in serialization_log.filters:
        serialization_log.addFilter(_not_a_none_leaf)

    is_named = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
    raw = jax.tree.map(lambda x: x.array if is_named(x) else x, exemplar, is_leaf=is_named)
    loaded = load_checkpoint(raw, path, subpath=subpath, read_config=_read_config())
    return jax.tree.unflatten(jax.tree.structure(exemplar), jax.tree.leaves(loaded))
