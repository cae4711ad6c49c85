"""Your own data: a JSON-lines corpus -> documents -> a BPE tokenizer -> packed token caches -> a tiny MoE.

    uv run --locked keel run experiments/tutorials/own_data.py     # a minute or two on 2 CPU cores
    uv run --locked keel plan experiments/tutorials/own_data.py    # then: everything cached

The corpus is `data/own_corpus.jsonl` (made by `data/make_own_corpus.py`): 300 notes whose text is
in the `body` field, with one line cut off and one holding a non-UTF-8 byte. Point `CORPUS` at your
own files (paths or globs, relative to where you run keel, local or gs://...; `.txt`, `.jsonl`,
`.jsonl.gz`, `.jsonl.zst`, `.parquet`) and set `text_field` to the field that holds the text.

What the documents step does with your data: one document per record (a `.txt` file is one
document), its id `file:line`; a hash of the id puts `validation_fraction` of them in the
validation split. A record it cannot read is skipped and counted (the console line and
`.keel/summary.json` under the step's output give counts by kind and the first file:line); more
than `max_bad_fraction` (1%) skipped fails the step, and so does an empty corpus. Edit the corpus
and `keel plan` shows this step and everything after it stale, naming the file.

The training run takes its sequence length from the cache; the model's vocabulary must hold the
tokenizer's: `keel plan` refuses a model that cannot, before anything runs.
"""

from defaults import default_tokenize, default_tokenizer, default_train, ingest
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel import main
from keel.spec import TrainConfig

CORPUS = "experiments/tutorials/data/own_corpus.jsonl"
VOCAB = 384

documents = ingest("own-notes", (CORPUS,), text_field="body", validation_fraction=0.05)
tokenizer = default_tokenizer("own-notes-bpe-384", documents, vocab_size=VOCAB)
tokens = default_tokenize("own-notes-bpe-384-64", documents, tokenizer, seq_len=64)

model_config = tiny_moe.replace(vocab_size=VOCAB)  # the tokenizer's vocabulary, not more or less
train = TrainConfig(
    batch_size=16,
    num_steps=60,
    optimizer=hero_lr_law.optimizer(),
    eval_every=20,
    eval_batches=2,
    rolling_checkpoint_minutes=None,
    compute_dtype="float32",  # bf16 is emulated on CPUs (defaults.hardware.cpu_sim)
)
model = default_train("own_notes", data=tokens, model=model_config, train=train,
                      description="tiny MoE on your own corpus")

if __name__ == "__main__":
    main([model])
