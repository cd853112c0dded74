"""Indexed datasets (.bin/.idx), tokenizers, the embedded corpus, packing, blending and the resumable sampler."""
