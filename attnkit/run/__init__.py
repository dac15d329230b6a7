"""The run directory and every file attnkit reads back."""
