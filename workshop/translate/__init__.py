"""Translating with a trained checkpoint, and scoring translations (BLEU)."""
