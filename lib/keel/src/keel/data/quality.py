"""What a data step skipped or repaired, record by record, and when that is too much to go on.

Readers count every record they look at (`look`), report the ones they drop (`skip`, with a kind
such as "not valid JSON" and the file:line it came from) and the ones they keep after a repair
(`repair`: undecodable bytes replaced). Skipped records above `max_fraction` of those looked at
fail the step (`check`), and `fail_fast` fails it at the first one; a step whose first
`ALL_SKIPPED_AFTER` records were all skipped fails there (with a limit below 1), before reading
the rest. Below the limit, the counts per kind, each with its first example, go to the console
and to the step's summary.json. Losing data is never silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_EXAMPLES = 100
ALL_SKIPPED_AFTER = 1000
"""A step whose first this many records were all skipped fails there, not after reading the rest:
a wrong `text_field` or format skips every record, and the corpus may be large."""
MAX_NOISE_FRACTION = 0.1
"""Text with more of its characters undecodable bytes or control characters than this is binary
data, not text to repair (text with a stray Latin-1 byte here and there has far fewer)."""
_CONTROL = {c for c in range(32) if chr(c) not in "\t\n\r\f\v"}


def not_text(data: bytes) -> str | None:
    """Why `data` is binary rather than text with a few bad bytes, or None: repairing such a file
    line by line would turn noise into documents."""
    if b"\x00" in data:
        return "contains NUL bytes"
    text = data.decode("utf-8", errors="replace")
    noise = text.count("\ufffd") + sum(text.count(chr(c)) for c in _CONTROL)
    if text and noise > MAX_NOISE_FRACTION * len(text):
        return f"{noise / len(text):.0%} of its characters are undecodable bytes or control characters"
    return None


class BadRecordError(ValueError):
    """Input records that cannot be turned into documents, more of them than the config accepts."""


@dataclass(frozen=True)
class BadRecord:
    file: str
    line: int
    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.kind}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class _Kind:
    count: int
    first: BadRecord


@dataclass
class RecordLog:
    """Counts of records looked at, skipped and repaired; `limit` names the setting in messages."""

    fail_fast: bool = False
    max_fraction: float | None = None
    limit: str = "max_bad_fraction"
    records: int = 0
    skipped: dict[str, _Kind] = field(default_factory=dict)
    repaired: dict[str, _Kind] = field(default_factory=dict)
    examples: list[BadRecord] = field(default_factory=list)

    def look(self, n: int = 1) -> None:
        self.records += n

    def skip(self, record: BadRecord) -> None:
        if self.fail_fast:
            raise BadRecordError(f"bad record at {record} (on_bad_record='fail'; 'skip' skips and counts such records)")
        _add(self.skipped, record)
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(record)
        if self.records == ALL_SKIPPED_AFTER == self.skipped_count and self.max_fraction is not None and self.max_fraction < 1:
            raise BadRecordError(
                f"the first {self.records:,} records were all skipped: {_kinds(self.skipped)}; nothing has been "
                f"written. Fix the input or the config reading it ({self.limit}={self.max_fraction:g} allows "
                "some loss, not all of it)"
            )

    def repair(self, record: BadRecord) -> None:
        _add(self.repaired, record)

    def skipped_counts(self) -> dict[str, int]:
        """Skipped records so far, by kind."""
        return {kind: k.count for kind, k in self.skipped.items()}

    @property
    def skipped_count(self) -> int:
        return sum(k.count for k in self.skipped.values())

    def check(self) -> None:
        """Raise BadRecordError when more than `max_fraction` of the records looked at were skipped."""
        skipped = self.skipped_count
        if self.max_fraction is None or skipped <= self.max_fraction * self.records:
            return
        raise BadRecordError(
            f"{skipped} of {self.records} records ({skipped / self.records:.1%}) were skipped, more than "
            f"{self.limit}={self.max_fraction:g} allows: {_kinds(self.skipped)}; fix the data, or raise "
            f"{self.limit} to accept the loss"
        )

    def summary(self) -> dict:
        def plain(kinds: dict[str, _Kind]) -> dict:
            return {kind: {"count": k.count, "first": str(k.first)} for kind, k in kinds.items()}

        return {"records": self.records, "skipped": plain(self.skipped), "repaired": plain(self.repaired)}

    def describe(self) -> str:
        """'' when nothing was skipped or repaired, else e.g. 'skipped 1 of 300 records (0.3%): ...'."""
        parts = []
        if self.skipped:
            skipped = self.skipped_count
            parts.append(f"skipped {skipped} of {self.records} records ({skipped / max(self.records, 1):.1%}): "
                         f"{_kinds(self.skipped)}")
        if self.repaired:
            parts.append(f"repaired {sum(k.count for k in self.repaired.values())}: {_kinds(self.repaired)}")
        return "; ".join(parts)


def _add(kinds: dict[str, _Kind], record: BadRecord) -> None:
    if record.kind in kinds:
        kinds[record.kind].count += 1
    else:
        kinds[record.kind] = _Kind(1, record)


def _kinds(kinds: dict[str, _Kind]) -> str:
    def first(record: BadRecord) -> str:
        return f"{record.file}:{record.line}" + (f", {record.detail}" if record.detail else "")

    return ", ".join(f"{k.count} {kind} (first: {first(k.first)})" for kind, k in kinds.items())
