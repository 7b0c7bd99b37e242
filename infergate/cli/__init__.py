"""The Typer CLI: one app per noun. Heavy imports stay inside the commands."""
