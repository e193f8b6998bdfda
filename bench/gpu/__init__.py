"""The parts of bench/gpu_check.py: one check per module, and what they share."""
