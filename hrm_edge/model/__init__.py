"""The model: one HRM-LM definition (hrm_edge.model.lm: the shared block, its three iteration forms and the
caches) that training, every export and the parity reference use; checkpoints; eager decoding."""
