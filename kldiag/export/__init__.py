"""Exports of an analysis to the tools users already look at (TensorBoard, and W&B through it)."""
