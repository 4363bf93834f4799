"""Data and training: the pinned PyPI corpus, token windows, the BPE tokenizer, the presets and the training loop
(`python -m hrm_edge.train`)."""
