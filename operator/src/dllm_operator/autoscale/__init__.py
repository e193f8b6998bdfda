"""PD-aware autoscaling (issue 36): the pure decision (decide.py) over measured signals."""
