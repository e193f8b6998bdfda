"""The parts of bench/kv_transfer.py, one idea per module."""
