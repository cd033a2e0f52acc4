"""tenx: the whole pre-training program of a GPT-style language model."""

__version__ = "0.1.0"
