"""Evaluation: benchmarks (one file each, one row schema), scorers, the runner, reports and plots."""
