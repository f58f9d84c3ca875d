"""draftsmith: train draft models for speculative decoding, and decode with them losslessly."""

__version__ = "0.1.0"
