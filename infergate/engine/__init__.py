"""The core of infergate, with no HTTP in it."""
