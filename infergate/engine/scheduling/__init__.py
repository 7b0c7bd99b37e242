"""Between admission and the workers: priority classes, deadlines, dynamic batching."""
