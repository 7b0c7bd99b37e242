"""infergate: a single-node inference gateway speaking the KServe V2 protocol."""

__version__ = "0.1.0"
