"""What is on disk: the models folder, model.toml, verification and the file watcher."""
