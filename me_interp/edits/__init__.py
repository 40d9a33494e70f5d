"""Weight edits as context managers that always restore the original weights."""
