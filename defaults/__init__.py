from defaults.data import default_tokenize, default_tokenizer, ingest, stdlib_corpus

__all__ = ["default_tokenize", "default_tokenizer", "ingest", "stdlib_corpus"]
