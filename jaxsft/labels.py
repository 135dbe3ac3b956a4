"""The label convention the data pipeline and the loss share (no imports: the loss must not pull in
the data package, nor the data package jax)."""

IGNORE_INDEX = -100
"""The Hugging Face label that means "not trained": positions labelled -100 (prompt tokens, padding,
fill rows, packed-segment starts) contribute nothing to the loss or to the valid-token count."""
