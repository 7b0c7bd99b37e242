"""Triton's extensions in engine terms: model configuration, statistics, sequences,
classification, shared memory."""
