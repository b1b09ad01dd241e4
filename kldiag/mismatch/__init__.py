"""Mismatch studies: trainer/engine parity fits, the drift/mismatch decomposition and what-if replays."""
