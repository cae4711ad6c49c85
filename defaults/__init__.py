from defaults.data import default_tokenize, default_tokenizer, ingest, stdlib_corpus, stdlib_tokens
from defaults.research import default_compare, default_eval, default_sample, default_scaling_ladder
from defaults.train import default_train

__all__ = ["default_compare", "default_eval", "default_sample", "default_scaling_ladder", "default_tokenize", "default_tokenizer",
           "default_train", "ingest", "stdlib_corpus", "stdlib_tokens"]
