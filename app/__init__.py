"""specserve: speculative-decoding text generation."""

__version__ = "0.1.0"
