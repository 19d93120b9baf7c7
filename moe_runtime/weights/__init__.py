"""Weights: checkpoint reading, loading, random weights, quantized formats."""
