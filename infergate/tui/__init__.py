"""`infergate top`: the Textual dashboard."""
