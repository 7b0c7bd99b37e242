"""HTTP: translate requests to engine calls and results back, nothing more."""
