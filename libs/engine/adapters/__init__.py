"""Experts in the engine: weights, the host and device tiers, per-step adapter batches."""
