"""Text: the tokenizer and chat template, and incremental detokenization."""
