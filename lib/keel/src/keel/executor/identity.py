"""Content addressing: a step's identity payload, its hash and its output path.

Identity = name + every config field that is not execution-only + what its execution-only fields
decide about the results where they decide any (`DerivesIdentity.derived_identity`) + the
identities of the dependencies + the fingerprints of the files it reads from outside keel (those
its config's `input_files()` names, an External's files; see `inputs.py`). Everything counts
unless declared otherwise, so a changed config or an edited input file can never silently reuse a
stale output. The encoding is canonical JSON: stable across processes, hash seeds and machines. Changing it re-keys every output, so `tests/test_executor_identity.py` pins golden hashes.

The identity hash names the output path (`{name}-{hash}`). The *content* hash leaves the name out:
the step's function, its config and input files, and its dependencies' content hashes. Two steps
that do the same work under different names (in two experiment files, say) have one content
hash, so the second finds the first's finished output and reuses it (`plan.py`).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import ChainMap

from keel.executor import storage
from keel.executor.code import fingerprint, qualified_name
from keel.executor.encoding import canonical_json, encode
from keel.executor.graph import CycleError, topological_order
from keel.executor.inputs import InputError, fingerprint_files, fingerprint_tree
from keel.executor.step import DerivesIdentity, External, ReadsFiles, Step, StepDeclarationError

HASH_CHARS = 10


def _fingerprinted(name: str, read) -> dict:
    """The fingerprints of a step's (or External's) input files; a file that cannot be found or read
    is a declaration error naming the step, raised before anything runs."""
    try:
        return read()
    except StepDeclarationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any store's error (missing file, no credentials) is the same mistake
        raise InputError(f"step {name!r}: cannot fingerprint its input files ({exc}); fix the path, or declare a "
                         "version (IngestConfig.input_version, External(version=...)) to stand for them") from exc


@functools.cache
def _reads_files(config_type: type) -> bool:
    """`ReadsFiles` by the config's class, once per class (a Protocol's isinstance costs ~9 us: a
    10,000-step plan paid 0.1 s for it)."""
    return issubclass(config_type, ReadsFiles)


@functools.cache
def _derives_identity(config_type: type) -> bool:
    return issubclass(config_type, DerivesIdentity)


class Identities:
    """Memoised identity payloads and hashes for the steps of one graph.

    A step's hash needs its dependencies' hashes, so a miss first hashes the missing ancestry
    bottom-up (a 10,000-deep chain must not recurse 10,000 deep), and a step met again while its
    own payload is being encoded (a config that came to hold the step itself) is a `CycleError`.
    """

    def __init__(self) -> None:
        # Keyed by the steps themselves (identity hashing, no `id()`: see `topological_order`),
        # which also keeps every memoised step alive.
        self._hashes: dict[Step | External, str] = {}
        self._payloads: dict[Step | External, dict] = {}
        self._contents: dict[Step | External, str] = {}
        self._local = threading.local()  # .encoding: steps whose payload this thread is encoding, outermost first

    def payload(self, step: Step | External) -> dict:
        found = self._payloads.get(step)
        if found is None:
            if isinstance(step, External):
                found = {"external": step.name, "path": step.path, "version": step.version}
                if step.version is None:  # its files stand for it (keel.executor.inputs)
                    found["inputs"] = _fingerprinted(step.name, lambda: fingerprint_tree(step.path))
            else:
                encoding = self._encoding()
                if step in encoding:
                    inner = list(encoding)
                    raise CycleError(inner[inner.index(step):] + [step])
                encoding[step] = None
                try:
                    found = {"name": step.name, "config": encode(step.config, f"{step.name}.config", self.hash)}
                    derived = step.config.derived_identity() if _derives_identity(type(step.config)) else None
                    if derived:
                        found["derived"] = encode(derived, f"{step.name}.config.derived_identity()", self.hash)
                finally:
                    del encoding[step]
                if _reads_files(type(step.config)):  # a config that reads outside files
                    files = _fingerprinted(step.name, lambda: fingerprint_files(step.config.input_files()))
                    if files:
                        found["inputs"] = files
            self._payloads[step] = found
        return found

    def content_hash(self, step: Step | External) -> str:
        """The hash of the work a step does, whatever its name: its function (by name and `code.fingerprint`:
        every experiment file's own functions are `__main__.<name>`, so the name alone would make two
        files' `make` the same work), config (with each dependency by its content hash) and input
        files; an External by its path, version and files."""
        found = self._contents.get(step)
        if found is None:
            self.hash(step)  # encodes every payload once, refusing cycles and unencodable values
            for node in topological_order([step], done=self._contents):
                payload = self.payload(node)
                if isinstance(node, External):
                    content = {k: v for k, v in payload.items() if k != "external"}
                else:
                    content = {"fn": qualified_name(node.fn), "code": fingerprint(node.fn),
                               "config": encode(node.config, f"{node.name}.config", self.content_hash),
                               "inputs": payload.get("inputs"),
                               **({"derived": payload["derived"]} if "derived" in payload else {})}
                self._contents[node] = hashlib.sha256(canonical_json(content).encode()).hexdigest()[:2 * HASH_CHARS]
            found = self._contents[step]
        return found

    def _encoding(self) -> dict[Step, None]:
        return self._local.__dict__.setdefault("encoding", {})

    def hash(self, step: Step | External) -> str:
        found = self._hashes.get(step)
        if found is None:
            hashes = self._hashes
            known = all(d in hashes for d in step.deps)
            # Steps being encoded are not walked again: meeting one in `payload` names the cycle.
            for node in [step] if known else topological_order([step], done=ChainMap(hashes, self._encoding())):
                digest = hashlib.sha256(canonical_json(self.payload(node)).encode()).hexdigest()
                hashes[node] = digest[:HASH_CHARS]
            found = hashes[step]
        return found


def output_path(prefix: str, step: Step | External, identities: Identities) -> str:
    """`{prefix}/{name}-{hash}` for a step; the declared path for an external input."""
    if isinstance(step, External):
        return step.path
    return storage.join(prefix, f"{step.name}-{identities.hash(step)}")
