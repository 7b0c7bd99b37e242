"""Worker processes: one per model instance; tensors cross in shared memory."""
