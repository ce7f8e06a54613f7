"""Evaluation: text datasets and the quality comparison of a model variant against its reference."""
