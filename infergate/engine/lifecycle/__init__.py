"""What serves: the registry of loaded models, served versions and their worker instances."""
