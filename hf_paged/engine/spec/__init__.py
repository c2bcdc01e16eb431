"""Speculative decoding on the engine: proposers (prompt lookup, a draft model) and the
verification of their tokens after a step."""
