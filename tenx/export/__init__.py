"""Exporting a trained model to other ecosystems: a Hugging Face `transformers` model directory."""
