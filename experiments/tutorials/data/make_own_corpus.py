"""Write own_corpus.jsonl, the small corpus of `experiments/tutorials/own_data.py` (run from anywhere).

    uv run --locked python experiments/tutorials/data/make_own_corpus.py [OUT]   # default: beside this file

300 short birdwatching notes made from templates with a fixed seed, one JSON object per line
(`{"id": ..., "title": ..., "body": ...}`; the text is in `body`), about 80 KB. Two lines are
broken on purpose, the way real corpora are: line 120 is cut off mid-record (not valid JSON: the
documents step skips and counts it) and line 240 holds a Latin-1 byte (not UTF-8: the step
replaces it with U+FFFD and counts it). The output is the same on every run.
"""

import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).with_name("own_corpus.jsonl")
DOCUMENTS = 300
CUT_OFF_LINE, LATIN1_LINE = 120, 240

BIRDS = ["heron", "kestrel", "wren", "curlew", "swift", "plover", "jay", "osprey", "lapwing", "finch"]
PLACES = ["the estuary", "the north meadow", "the old quarry", "the reed beds", "the beech wood", "the harbour wall"]
WEATHER = ["clear and cold", "grey with drizzle", "windy from the west", "warm and still", "foggy until noon"]
ACTIONS = ["feeding on the mud", "circling high", "calling from cover", "resting on a post", "chasing insects",
           "building a nest"]


def note(rng: random.Random, i: int) -> dict:
    bird, place = rng.choice(BIRDS), rng.choice(PLACES)
    count = rng.randint(1, 12)
    sentences = [
        f"Day {i + 1}. The weather was {rng.choice(WEATHER)}.",
        f"At {place} I counted {count} {bird}{'s' if count > 1 else ''} {rng.choice(ACTIONS)}.",
        f"Later a {rng.choice(BIRDS)} was {rng.choice(ACTIONS)} near {rng.choice(PLACES)}.",
        f"Total for the day: {count + rng.randint(0, 9)} birds of {rng.randint(2, 8)} kinds.",
    ]
    return {"id": f"note-{i:04d}", "title": f"{bird} at {place}", "body": " ".join(sentences)}


def main(out: Path = OUT) -> None:
    rng = random.Random(0)
    lines = [json.dumps(note(rng, i)).encode() for i in range(DOCUMENTS)]
    lines.insert(CUT_OFF_LINE - 1, json.dumps(note(rng, DOCUMENTS)).encode()[:40])
    lines[LATIN1_LINE - 1] = json.dumps({"id": "note-latin1", "title": "cafe", "body": "Coffee at the cafe, then "
                                         "the harbour wall."}).encode().replace(b"cafe,", "café,".encode("latin-1"))
    out.write_bytes(b"\n".join(lines) + b"\n")
    print(f"wrote {out} ({out.stat().st_size:,} bytes, {len(lines)} lines)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
