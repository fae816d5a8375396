"""Placeholder: this model family is being written."""
